"""The `launcher` command line (click): commands, `launcher dv`, `console` and `logs`, and the options they share.
Argument handling and output only; the work is in launcher.runtime and launcher.datavolumes."""
