"""GPU index -> device node from the driver's /proc files, and the broker's GPU numbering."""

from __future__ import annotations

from pathlib import Path

import pytest

from kcoral.broker.devices import GpuNode, gpu_nodes, normalize_bus_id, parse_information, read_information_files
from kcoral.broker.target import number_gpus

# As /proc/driver/nvidia/gpus/<bus id>/information reads on an H200 host (driver 570 and later);
# the tabs and spacing are the driver's.
H200_AT_19 = """Model: \t\t NVIDIA H200
IRQ:   \t\t 0
GPU UUID: \t GPU-3f1d6a52-7c1e-2b9a-8e44-0c6b1f7a9d21
Video BIOS: \t 96.00.ab.00.01
Bus Type: \t PCIe
DMA Size: \t 52 bits
DMA Mask: \t 0xfffffffffffff
Bus Location: \t 0000:19:00.0
Device Minor: \t 1
GPU Excluded:\t No
"""
H200_AT_3B = H200_AT_19.replace("0000:19:00.0", "0000:3b:00.0").replace("Device Minor: \t 1", "Device Minor: \t 0")
H200_AT_3B = H200_AT_3B.replace("GPU-3f1d6a52", "GPU-8a2b4c6d")
# An older driver's file: fewer fields, upper-case hex in the bus id.
A100_OLD = """Model: \t\t A100-SXM4-80GB
IRQ:   \t\t 151
GPU UUID: \t GPU-0b7e5d1c-aaaa-bbbb-cccc-1234567890ab
Video BIOS: \t 92.00.36.00.02
Bus Type: \t PCIe
DMA Size: \t 47 bits
DMA Mask: \t 0x7fffffffffff
Bus Location: \t 0000:B7:00.0
Device Minor: \t 2
Blacklisted:\t No
"""
EXCLUDED = H200_AT_19.replace("0000:19:00.0", "0000:ca:00.0").replace("Device Minor: \t 1", "Device Minor: \t 3")
EXCLUDED = EXCLUDED.replace("GPU Excluded:\t No", "GPU Excluded:\t Yes")


def test_parse_information_reads_the_key_value_lines() -> None:
    fields = parse_information(H200_AT_19)
    assert fields["Model"] == "NVIDIA H200"
    assert fields["Bus Location"] == "0000:19:00.0"
    assert fields["Device Minor"] == "1"
    assert fields["GPU UUID"] == "GPU-3f1d6a52-7c1e-2b9a-8e44-0c6b1f7a9d21"


@pytest.mark.parametrize(
    ("text", "normal"),
    [("00000000:19:00.0", "0000:19:00.0"), ("0000:B7:00.0", "0000:b7:00.0"), ("0001:3b:1f.7", "0001:3b:1f.7")],
)
def test_bus_ids_of_nvidia_smi_and_the_driver_normalize_alike(text: str, normal: str) -> None:
    assert normalize_bus_id(text) == normal


@pytest.mark.parametrize("bad", ["", "19:00.0", "0000:zz:00.0", "0000:19:00"])
def test_a_malformed_bus_id_is_refused(bad: str) -> None:
    with pytest.raises(ValueError):
        normalize_bus_id(bad)


def test_gpus_are_indexed_in_pci_order_with_the_drivers_minor() -> None:
    # The driver probed the GPU at 3b first (minor 0): the minor is not the index.
    nodes = gpu_nodes({"0000:3b:00.0": H200_AT_3B, "0000:19:00.0": H200_AT_19})
    assert nodes == [
        GpuNode(0, "0000:19:00.0", 1, "GPU-3f1d6a52-7c1e-2b9a-8e44-0c6b1f7a9d21", "NVIDIA H200"),
        GpuNode(1, "0000:3b:00.0", 0, "GPU-8a2b4c6d-7c1e-2b9a-8e44-0c6b1f7a9d21", "NVIDIA H200"),
    ]
    assert [str(n.device) for n in nodes] == ["/dev/nvidia1", "/dev/nvidia0"]


def test_excluded_unreadable_and_old_format_files() -> None:
    nodes = gpu_nodes(
        {
            "0000:b7:00.0": A100_OLD,
            "0000:ca:00.0": EXCLUDED,
            "0000:19:00.0": H200_AT_19,
            "0000:20:00.0": "Model: \t\t NVIDIA H200\nDevice Minor: \t garbled\n",
        }
    )
    assert [(n.index, n.bus_id, n.minor) for n in nodes] == [(0, "0000:19:00.0", 1), (1, "0000:b7:00.0", 2)]


def test_two_gpus_claiming_one_minor_is_an_error() -> None:
    with pytest.raises(ValueError, match="share a device minor"):
        gpu_nodes({"a": H200_AT_19, "b": H200_AT_19.replace("0000:19:00.0", "0000:3b:00.0")})


def test_read_information_files_from_a_directory(tmp_path: Path) -> None:
    for bus, text in (("0000:19:00.0", H200_AT_19), ("0000:3b:00.0", H200_AT_3B)):
        (tmp_path / bus).mkdir()
        (tmp_path / bus / "information").write_text(text)
    (tmp_path / "0000:99:00.0").mkdir()  # no information file: skipped
    assert sorted(read_information_files(tmp_path)) == ["0000:19:00.0", "0000:3b:00.0"]
    assert read_information_files(tmp_path / "absent") == {}


SMI_CSV = """1, 00000000:3B:00.0, GPU-8a2b4c6d-7c1e-2b9a-8e44-0c6b1f7a9d21, NVIDIA H200, 9.0, 143771
0, 00000000:19:00.0, GPU-3f1d6a52-7c1e-2b9a-8e44-0c6b1f7a9d21, NVIDIA H200, 9.0, 143771
"""


def test_broker_numbers_nvidia_smi_gpus_by_pci_bus_and_binds_the_drivers_minor() -> None:
    nodes = gpu_nodes({"0000:3b:00.0": H200_AT_3B, "0000:19:00.0": H200_AT_19})
    gpus = number_gpus(SMI_CSV, nodes)
    assert [(g.index, g.pci_bus_id, g.minor, g.memory_mib) for g in gpus] == [
        (0, "0000:19:00.0", 1, 143771),
        (1, "0000:3b:00.0", 0, 143771),
    ]
    assert gpus[0].uuid == "GPU-3f1d6a52-7c1e-2b9a-8e44-0c6b1f7a9d21"


def test_without_the_drivers_files_the_minor_is_nvidia_smis_index() -> None:
    gpus = number_gpus(SMI_CSV, [])
    assert [(g.index, g.minor) for g in gpus] == [(0, 0), (1, 1)]


def test_a_gpu_the_driver_does_not_list_gets_no_node() -> None:
    nodes = gpu_nodes({"0000:19:00.0": H200_AT_19})
    assert [(g.index, g.minor) for g in number_gpus(SMI_CSV, nodes)] == [(0, 1), (1, None)]
