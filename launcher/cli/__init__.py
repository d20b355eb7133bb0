"""The `launcher` command line (click): commands, `launcher dv`, and the options they share.
Argument handling and output only; the work is in launcher.runtime and launcher.datavolumes."""
