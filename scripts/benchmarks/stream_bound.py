"""Which bound a streamed target pass is under, and so which figure may be claimed.

A disk-tier pass overlaps its layer reads with its compute, so it takes about the
longer of the two. Stream efficiency (bytes streamed over wall time, against the raw
O_DIRECT read speed) says how well the streaming works only where the reads are the
longer part. Where compute is, the efficiency is at most reads / compute however well
the reads hide: SmolLM2 on a 2-core AVX2 EPYC (5.4-6.5 GB/s disk) computes a pass in
~75-100 ms against ~35 ms of reads and shows 0.37-0.41 with 98% of the read time
hidden. There the figure is the hidden fraction: the share of the pass's read time
(at the raw speed) that compute did not wait for.

bench_stream.py and bench.py's goal line both decide here.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass


@dataclass(frozen=True)
class StreamBound:
    bound: str
    """'read' (the reads take longer than the compute) or 'compute'."""
    efficiency: float
    """Achieved GB/s over raw GB/s; meaningful only when read-bound."""
    hidden_fraction: float
    """1 - waiting / (bytes / raw speed), clipped to [0, 1]; the figure when compute-bound."""
    compute_ms: float
    """Per pass: wall time less the time compute waited on reads."""
    read_ms: float
    """Per pass: the bytes' read time at the raw speed."""

    @property
    def figure(self) -> tuple[str, float]:
        """The one figure to claim: (its name, its value)."""
        if self.bound == "read":
            return "stream_efficiency", self.efficiency
        return "read_hidden_fraction", self.hidden_fraction

    def describe(self) -> str:
        if self.bound == "read":
            return (f"read-bound ({self.read_ms:.1f} ms of reads at raw speed against {self.compute_ms:.1f} ms of "
                    f"compute): stream efficiency {self.efficiency:.3f}")
        return (f"compute-bound ({self.compute_ms:.1f} ms of compute against {self.read_ms:.1f} ms of reads at raw "
                f"speed): {self.hidden_fraction:.0%} of the read time hidden behind compute; achieved / raw "
                f"({self.efficiency:.3f}) measures the compute here, not the streaming")

    def as_json(self) -> dict[str, float | str]:
        out: dict[str, float | str] = {k: round(v, 3) if isinstance(v, float) else v for k, v in asdict(self).items()}
        out["figure"] = self.figure[0]
        return out


def stream_bound(*, bytes_per_pass: float, seconds_per_pass: float, waiting_per_pass: float,
                 raw_gbps: float) -> StreamBound:
    """Classify passes from what the layer store counted (bytes, seconds waiting) and
    the wall time, against the raw read speed measured beside them."""
    read = bytes_per_pass / (raw_gbps * 1e9)
    compute = max(0.0, seconds_per_pass - waiting_per_pass)
    hidden = min(1.0, max(0.0, 1.0 - waiting_per_pass / read)) if read > 0 else 1.0
    efficiency = bytes_per_pass / seconds_per_pass / (raw_gbps * 1e9) if seconds_per_pass > 0 else 0.0
    return StreamBound(bound="read" if read >= compute else "compute", efficiency=efficiency,
                       hidden_fraction=hidden, compute_ms=compute * 1e3, read_ms=read * 1e3)
