"""The `diskkit` command line (click), and the flags and error exits it shares with the
launcher's. Argument handling only: the work is in diskkit.ops."""
