"""`pagoda tune`: measured trials that find the serving flags with the most goodput under SLOs.

Modules: ``setting`` (the knobs and their values, flags and config files), ``trial`` (one server,
its load levels, goodput), ``search`` (which settings to try, within a budget), ``report`` (the
table, the config file, JSON and a plot), ``command`` (the command line).
"""
