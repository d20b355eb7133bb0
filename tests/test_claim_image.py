"""A filesystem claim without disk.img gets one, as KubeVirt's pkg/host-disk/host-disk.go makes it:
sparse, qemu's, sized from the claim (replaceForHostDisk: its request unless its capacity is smaller,
whole MiB), and shrunk within the tolerance only when the volume holds less (sizing's tests).

Here the size comes from the claim object in --manifests beside a --pvc directory that names no size:
the example pod's VMI and its claim (examples/kubernetes), as `launcher run --manifests
examples/kubernetes --pvc testguest-data=DIR` would take them.
"""

from __future__ import annotations

import os
import stat
from pathlib import Path

import pytest
import yaml

from diskkit.errors import DiskkitError
from launcher.node.cache import Cache
from launcher.spec.k8s import Objects
from launcher.spec.vmi import load_vmi
from launcher.volumes.claims import claim_disk
from launcher.volumes.context import Context
from launcher.volumes.storage import LocalClaim, Storage

EXAMPLES = Path(__file__).resolve().parent.parent / "examples" / "kubernetes"


def _context(tmp_path: Path, store: Storage) -> tuple[Context, object]:
    (configmap,) = [d for d in yaml.safe_load_all((EXAMPLES / "configmap.yaml").read_text()) if d]
    vmi_file = tmp_path / "vmi.yaml"
    vmi_file.write_text(configmap["data"]["vmi.yaml"])
    vmi = load_vmi(vmi_file)
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    ctx = Context(vmi=vmi, cache=Cache(tmp_path / "cache"), run_dir=run_dir, registry=None, platform=None, create=True, store=store)
    (volume,) = [v for v in vmi.volumes if v.name == "data"]
    return ctx, volume


def test_the_claims_request_in_the_manifests_sizes_its_new_disk_img(tmp_path):
    claim = tmp_path / "claim"
    claim.mkdir()
    store = Storage(pvcs={"testguest-data": LocalClaim(claim)}, objects=Objects.load(EXAMPLES))
    ctx, volume = _context(tmp_path, store)
    disk = claim_disk(ctx, volume, "testguest-data", "spec.volumes[1]")
    image = os.stat(claim / "disk.img")
    assert disk.path == str(claim / "disk.img")
    assert image.st_size == 2 << 30  # pvc.yaml: requests.storage 2Gi
    assert image.st_blocks * 512 < 1 << 20  # sparse
    if os.geteuid() == 0:
        assert (image.st_uid, image.st_gid) == (107, 107)  # qemu's, as virt-handler makes it
    assert sorted(p.name for p in claim.iterdir()) == ["disk.img"]


def test_without_a_size_nothing_is_created_and_the_refusal_says_how_to_give_one(tmp_path):
    claim = tmp_path / "claim"
    claim.mkdir()
    ctx, volume = _context(tmp_path, Storage(pvcs={"testguest-data": LocalClaim(claim)}))
    with pytest.raises(DiskkitError) as err:
        claim_disk(ctx, volume, "testguest-data", "spec.volumes[1]")
    assert err.value.rule == (f"claim testguest-data: {claim / 'disk.img'} does not exist and no size is known"
                              " (--pvc testguest-data=DIR:SIZE, or the claim in --manifests)")
    assert list(claim.iterdir()) == []


NOBODY = 65534


@pytest.mark.parametrize("mode", [0o755, 0o555])
def test_root_makes_the_image_in_a_users_claim_as_that_user(tmp_path, mode):
    """The trust rule of launcher.hostfs: in a claim a user owns, root works as that user. So the image
    appears where its owner may write (then is qemu's), and nowhere its owner may not: root's own
    rights make nothing there (before, a claim closed to its owner still got root's disk.img)."""
    claim = tmp_path / "claim"
    claim.mkdir()
    os.chown(claim, NOBODY, NOBODY)
    claim.chmod(mode)
    store = Storage(pvcs={"testguest-data": LocalClaim(claim, 16 << 20)})
    ctx, volume = _context(tmp_path, store)
    if mode & 0o200:
        claim_disk(ctx, volume, "testguest-data", "spec.volumes[1]")
        image = os.stat(claim / "disk.img")
        assert (image.st_size, image.st_uid, image.st_gid) == (16 << 20, 107, 107)
    else:
        with pytest.raises(DiskkitError) as err:
            claim_disk(ctx, volume, "testguest-data", "spec.volumes[1]")
        assert err.value.rule.endswith("(Permission denied)") and str(claim) in str(err.value.subject), err.value
        assert list(claim.iterdir()) == []


@pytest.mark.parametrize("planted", ["disk.img", ".disk.img.tmp"])
def test_a_link_planted_in_a_users_claim_leads_nowhere(tmp_path, planted):
    """launcher/volumes/files.create_sparse as the claim's owner: a link its owner planted under the
    image's name is refused, one under the staging name is removed, and what either names (a file of
    root's) is neither truncated nor given to qemu."""
    victim = tmp_path / "victim"
    victim.write_bytes(b"root's own" * 100)
    claim = tmp_path / "claim"
    claim.mkdir()
    os.chown(claim, NOBODY, NOBODY)
    os.symlink(victim, claim / planted)
    os.lchown(claim / planted, NOBODY, NOBODY)
    store = Storage(pvcs={"testguest-data": LocalClaim(claim, 16 << 20)})
    ctx, volume = _context(tmp_path, store)
    if planted == "disk.img":
        with pytest.raises(DiskkitError):
            claim_disk(ctx, volume, "testguest-data", "spec.volumes[1]")
    else:
        claim_disk(ctx, volume, "testguest-data", "spec.volumes[1]")
        image = os.lstat(claim / "disk.img")
        assert stat.S_ISREG(image.st_mode) and (image.st_size, image.st_uid) == (16 << 20, 107)
        assert not os.path.lexists(claim / planted)
    kept = os.stat(victim)
    assert (victim.read_bytes(), kept.st_uid) == (b"root's own" * 100, 0)
