"""How ranks start: torchrun environment variables (``underlay.parallel.init_distributed``) and Ray worker groups."""
