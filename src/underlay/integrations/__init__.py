"""Optional integrations of underlay into other frameworks.

Each subpackage imports its framework (which the core never does: an import-linter contract keeps
``verl`` out of every other module) and is imported only by users of that framework.
"""
