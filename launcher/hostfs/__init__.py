"""Files in directories that someone other than the launcher can write: claim directories (their
owner, and a guest through them), socket directories given on the command line.

Whoever can write such a directory can plant a symbolic link, a hard link, a FIFO or a device node
under any name the launcher will use, or swap a directory the launcher made for a link between two of
its steps. Everything the launcher opens, creates, truncates, renames, chowns or chmods there goes
through `launcher.hostfs.dirfd`: names resolved one component at a time relative to a directory fd,
never following a link, only regular files opened, ownership and modes changed on the open fd.
"""
