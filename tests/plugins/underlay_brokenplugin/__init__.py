"""A plugin whose import fails, to test that the error names the plugin and its exception."""

raise ImportError("underlay_brokenplugin needs libfoo, which is not installed")
