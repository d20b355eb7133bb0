"""libvirt's test:/// driver as the bookkeeping tests use it (virt-manager's tests do the same): a
node in this process, with its one domain `test`, that lives while a connection to it is open."""

from __future__ import annotations

from launcher.runtime.runner import Libvirt

TEST_URI = "test:///default"


def close_node(lv: Libvirt) -> None:
    """Remove every domain a test made, then close: the next test's node is a fresh one only once every
    connection is closed, and a connection some code left to the garbage collector must not hand it
    this test's domains."""
    for domain in lv.conn.listAllDomains():
        if domain.name() != "test":
            if domain.isActive():
                domain.destroy()
            domain.undefine()
    lv.close()
