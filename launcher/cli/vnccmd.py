"""`launcher vnc NAME` and `launcher vnc screenshot NAME -f FILE`, as `virtctl vnc` and `virtctl vnc
screenshot` (pkg/virtctl/vnc/vnc.go, pkg/virtctl/vnc/screenshot/screenshot.go): the viewer's choice,
its arguments and the messages are virtctl's."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys

import click

from diskkit.errors import DiskkitError
from launcher.cli.options import cache_option, node_cache, say

REMOTE_VIEWER, TIGER_VNC = "remote-viewer", "vncviewer"
VNC_TYPES = {"tiger": TIGER_VNC, "remote-viewer": REMOTE_VIEWER}


def viewer_command(vnc_type: str | None, vnc_path: str | None, address: str, port: int,
                   which=shutil.which) -> list[str]:
    """virtctl's getUserSpecifiedVnc / getAutoDetectedVnc on Linux: remote-viewer, else TigerVNC's vncviewer."""
    if vnc_type is None:
        for binary in (REMOTE_VIEWER, TIGER_VNC):
            if which(binary):
                vnc_type = next(k for k, v in VNC_TYPES.items() if v == binary)
                vnc_path = which(binary)
                break
        else:
            raise DiskkitError("vnc", f"could not find {REMOTE_VIEWER} or {TIGER_VNC} binary in $PATH"
                                      " (--proxy-only prints the port for a viewer of your own)")
    if vnc_type not in VNC_TYPES:
        raise DiskkitError("--vnc-type", f"unsupported vnc-type for linux: {vnc_type}")
    if vnc_path is None:
        vnc_path = which(VNC_TYPES[vnc_type])
        if vnc_path is None:
            raise DiskkitError("--vnc-type", f"could not find {VNC_TYPES[vnc_type]} in $PATH")
    if vnc_type == "remote-viewer":
        return [vnc_path, f"vnc://127.0.0.1:{port}"]  # remoteViewerArgs
    return [vnc_path, f"{address}:{port}"]  # tigerVncArgs: TigerVNC takes a display over 99 as a port


@click.command(epilog="""\b
Examples:
  launcher vnc testvm                          # remote-viewer or vncviewer, whichever is installed
  launcher vnc --proxy-only testvm             # {"port": 40123}: point any VNC viewer at 127.0.0.1:40123
  launcher vnc screenshot testvm -f screen.png
  launcher vnc screenshot testvm -f - | display
""")
@click.argument("name", metavar="NAME | screenshot NAME")
@click.argument("vmi", required=False, metavar="")
@click.option("--address", default="127.0.0.1", show_default=True, help="Where the proxy listens (with --proxy-only; a viewer this command starts always gets 127.0.0.1). Whatever the address, only sockets of this user on this machine are served.")
@click.option("--port", type=click.IntRange(0, 65535), default=0, help="The proxy's port (default: a free one).")
@click.option("--proxy-only", is_flag=True, help='Run only the proxy and print {"port": N}; wait for a viewer as long as it takes.')
@click.option("--vnc-type", type=click.Choice(sorted(VNC_TYPES)), help="The viewer to start (default: remote-viewer, else vncviewer, from $PATH).")
@click.option("--vnc-path", type=click.Path(exists=True, dir_okay=False), help="The viewer's executable.")
@click.option("-f", "--file", "file_name", metavar="FILE", help="screenshot: where the PNG goes; - for stdout (required).")
@cache_option
def vnc(name, vmi, address, port, proxy_only, vnc_type, vnc_path, file_name, cache_dir) -> None:
    """Open the VM's VNC display (NAME, NAMESPACE/NAME or domain name) in a viewer, through a proxy on
    a local TCP port; or, as `vnc screenshot NAME -f FILE`, save its screen as a PNG.

    Every VM has a VNC display and a VGA card (KubeVirt's autoattachGraphicsDevice, on unless the
    spec turns it off). The proxy serves one viewer: the command ends when it hangs up. A viewer the
    command starts has 60 s to connect. Connections from sockets of another local user are refused:
    the display is the guest's console.
    """
    from launcher.runtime import vnc as display
    from launcher.runtime.lookup import connect, record_of

    screenshot = name == "screenshot" and vmi is not None
    if vmi is not None and not screenshot:
        raise DiskkitError(vmi, "one VM at a time: launcher vnc NAME, or launcher vnc screenshot NAME -f FILE")
    target = vmi if screenshot else name
    if screenshot and not file_name:
        raise DiskkitError("screenshot", 'required flag(s) "file" not set')  # cobra's words for MarkFlagRequired
    cache = node_cache(cache_dir)
    record = record_of(cache, target)
    lv = connect(record)
    try:
        if not lv.active(record["domain"]):
            raise DiskkitError(target, "VMI is not running")
        if screenshot:
            image = display.screenshot(lv, record["domain"])
            if file_name == "-":
                sys.stdout.buffer.write(image)
                sys.stdout.buffer.flush()
                return
            try:
                with open(file_name, "wb") as out:
                    out.write(image)
            except OSError as exc:
                raise DiskkitError(file_name, f"Can't write image to a file: {exc.strerror}") from None  # virtctl's words
            return
        if not proxy_only:
            address = "127.0.0.1"  # vnc.go: without --proxy-only the proxy listens on localhost
        with display.listen(address, port) as listener:
            bound = listener.getsockname()[1]
            if proxy_only:
                click.echo(json.dumps({"port": bound}))
                display.serve(lv, record["domain"], listener, None, say)
                return
            viewer = subprocess.Popen(viewer_command(vnc_type, vnc_path, address, bound), stdin=subprocess.DEVNULL)
            try:
                display.serve(lv, record["domain"], listener, display.LISTEN_TIMEOUT, say,
                              lambda: None if viewer.poll() is None else f"the viewer exited ({viewer.returncode}) before it connected")
            finally:  # the display closed, or the viewer hung up: it goes, as virtctl's context ends it
                if viewer.poll() is None:
                    viewer.terminate()
                    viewer.wait()
    finally:
        lv.close()
