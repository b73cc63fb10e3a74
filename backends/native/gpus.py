"""GPU types the planner knows: datasheet memory, bandwidth and bf16 peak, and how GPUs of a type are joined in
an 8-GPU server (no torch here: the CLI lists them at start-up)."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Interconnect:
    """A link between GPUs as a collective sees it: bandwidth per GPU and direction, and a fixed cost per
    operation (launch and synchronisation)."""

    name: str
    bandwidth_gbs: float  # GB/s per GPU and direction
    latency_us: float

    def all_reduce_s(self, size_bytes: float, ranks: int) -> float:
        """Seconds of a ring all-reduce of ``size_bytes`` over ``ranks`` GPUs (NCCL's: 2 (n-1)/n of the data
        crosses each link)."""
        if ranks == 1:
            return 0.0
        return self.latency_us * 1e-6 + 2 * (ranks - 1) / ranks * size_bytes / (self.bandwidth_gbs * 1e9)

    def gather_s(self, size_bytes: float, ranks: int) -> float:
        """Seconds to gather every other rank's ``size_bytes`` on one of ``ranks`` GPUs (its link takes them all)."""
        return self.latency_us * 1e-6 + (ranks - 1) * size_bytes / (self.bandwidth_gbs * 1e9)

    def send_s(self, size_bytes: float) -> float:
        """Seconds to send ``size_bytes`` from one GPU to another (a pipeline stage's hidden states)."""
        return self.latency_us * 1e-6 + size_bytes / (self.bandwidth_gbs * 1e9)


# Link rates from the datasheets (NVLink: the aggregate bidirectional figure halved); latencies are assumed,
# typical of NCCL's small-message collectives on each kind of link. Without peer-to-peer (GeForce 40 drivers, or
# NCCL_P2P_DISABLE=1 as the seed study ran its RTX 4090s) each transfer is staged through host memory: two PCIe
# crossings, so half the link rate and more time per operation.
INTERCONNECTS = {
    "nvlink4": Interconnect("NVLink 4 (900 GB/s)", 450, 8),
    "nvlink3": Interconnect("NVLink 3 (600 GB/s)", 300, 8),
    "nvlink-a800": Interconnect("NVLink 3, A800's (400 GB/s)", 200, 8),
    "pcie5": Interconnect("PCIe 5.0 x16", 64, 15),
    "pcie4": Interconnect("PCIe 4.0 x16", 32, 15),
    "pcie4-no-p2p": Interconnect("PCIe 4.0 x16 without peer-to-peer", 16, 30),
    # between nodes: one NIC per GPU
    "ib-400g": Interconnect("InfiniBand NDR 400 Gb/s", 50, 10),
    "ib-200g": Interconnect("InfiniBand HDR 200 Gb/s", 25, 10),
    "eth-100g": Interconnect("Ethernet 100 Gb/s (RoCE)", 12.5, 20),
}


@dataclass(frozen=True)
class GPU:
    name: str
    memory_gib: float
    bandwidth_gbs: float  # GB/s
    bf16_tflops: float  # dense, FP32 accumulate
    interconnect: str  # INTERCONNECTS' name of how 8 of them are joined in a server


# NVIDIA datasheets (SXM parts where there are several; GeForce and L40S: dense BF16 with FP32 accumulate). The RTX
# 3090's NVLink bridges join pairs only: an 8-GPU collective crosses PCIe.
GPUS = {
    "rtx3090": GPU("NVIDIA GeForce RTX 3090", 24, 936, 71, "pcie4"),
    "rtx4090": GPU("NVIDIA GeForce RTX 4090", 24, 1008, 165.2, "pcie4-no-p2p"),
    "a800-80g": GPU("NVIDIA A800 80GB SXM", 80, 2039, 312, "nvlink-a800"),
    "a100-40g": GPU("NVIDIA A100 40GB SXM", 40, 1555, 312, "nvlink3"),
    "a100-80g": GPU("NVIDIA A100 80GB SXM", 80, 2039, 312, "nvlink3"),
    "l40s": GPU("NVIDIA L40S", 48, 864, 362.05, "pcie4"),
    "h100": GPU("NVIDIA H100 SXM", 80, 3350, 989.4, "nvlink4"),
    "h200": GPU("NVIDIA H200 SXM", 141, 4800, 989.4, "nvlink4"),
}
