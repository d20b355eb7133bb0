"""KubeVirt's sizing rules for the images the launcher creates (pure)."""

from __future__ import annotations

import pytest

from diskkit.errors import DiskkitError
from launcher.volumes import sizing

MIB = 1 << 20


def test_image_size_is_the_smaller_of_request_and_capacity_in_whole_mib():
    assert sizing.image_size(10 * MIB + 5, 20 * MIB) == 10 * MIB
    assert sizing.image_size(None, 7 * MIB + 1) == 7 * MIB
    assert sizing.image_size(None, None) is None


def test_fit_keeps_the_request_when_it_fits_after_the_reserve():
    assert sizing.fit(100 * MIB, 100 * MIB + sizing.RESERVE, "data") == sizing.Fitted(100 * MIB, None)


# pkg/host-disk/host-disk.go shrinkRequestedSize: its event text and error, naming the disk's path
def test_fit_shrinks_within_the_tolerance_with_kubevirts_event_text():
    fitted = sizing.fit(100 * MIB, 95 * MIB + sizing.RESERVE, "data", path="/pvc/data/disk.img")
    assert fitted.size == 95 * MIB
    assert fitted.note == f"PV size too small: expected {100 * MIB} B, found {95 * MIB} B. Using it anyway, it is within 10 % toleration"


def test_fit_refuses_beyond_the_tolerance_with_kubevirts_message():
    with pytest.raises(DiskkitError) as err:
        sizing.fit(100 * MIB, 80 * MIB + sizing.RESERVE, "data", path="/pvc/data/disk.img")
    assert (err.value.subject, err.value.rule) == ("data", (
        f"unable to create /pvc/data/disk.img, not enough space, demanded size {100 * MIB} B is bigger than"
        f" available space {80 * MIB} B, also after taking 10 % toleration into account"))
    # A larger tolerance (pvcTolerateLessSpaceUpToPercent) lets the same claim through.
    assert sizing.fit(100 * MIB, 80 * MIB + sizing.RESERVE, "data", tolerance=25).size == 80 * MIB


def test_empty_disk_rounds_down_and_refuses_nothing():
    assert sizing.empty_disk_size(3 * MIB + 17, "scratch") == 3 * MIB
    with pytest.raises(DiskkitError) as err:
        sizing.empty_disk_size(MIB - 1, "scratch")
    assert err.value.rule == "the size for volume scratch is too low"


# pkg/host-disk/host-disk.go replaceForHostDisk: the size of the disk.img a filesystem claim gets.
def test_a_claim_image_is_the_request_unless_the_capacity_is_smaller_in_whole_mib():
    assert sizing.claim_image_size(10 * MIB + 5, 20 * MIB, "data") == 10 * MIB  # the disk the user asked for
    assert sizing.claim_image_size(20 * MIB, 10 * MIB + 5, "data") == 10 * MIB  # all the claim holds
    assert sizing.claim_image_size(None, 7 * MIB + 1, "data") == 7 * MIB
    assert sizing.claim_image_size(3 * MIB + 1, None, "data") == 3 * MIB  # --pvc DIR:SIZE: a request alone


def test_a_claim_image_without_any_size_or_below_one_mib_is_refused_in_kubevirts_words():
    with pytest.raises(DiskkitError) as err:
        sizing.claim_image_size(None, None, "data")
    assert err.value.rule == "unable to determine capacity of HostDisk from PVC that provides no storage capacity or requests"
    with pytest.raises(DiskkitError) as err:
        sizing.claim_image_size(MIB - 1, 10 * MIB, "data")
    assert err.value.rule == "the size for volume data is too low, must be at least 1MiB"
