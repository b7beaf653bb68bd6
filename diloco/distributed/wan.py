"""WAN emulation for one direction of a learner's link: a bandwidth token bucket and latency.

Transfers on one link are serialised (a link carries one byte stream): a transfer of n
bytes starts when the link is free, occupies it for n / bandwidth seconds, and arrives
`latency_s` later. `transfer` sleeps the caller until the bytes would have arrived, so
cross-region behaviour is measured on a real run instead of assumed.
"""

from __future__ import annotations

import threading
import time

from diloco.config.run_config import StoreConfig


class Link:
  """One direction of an emulated link; bandwidth 0 means unlimited."""

  def __init__(self, mbps: float = 0.0, latency_ms: float = 0.0, *, clock=time.monotonic,
               sleep=time.sleep):
    if mbps < 0 or latency_ms < 0:
      raise ValueError(f"link: bandwidth and latency must be >= 0, got {mbps} Mbit/s, "
                       f"{latency_ms} ms")
    self.bytes_per_s = mbps * 1e6 / 8
    self.latency_s = latency_ms / 1e3
    self._clock, self._sleep = clock, sleep
    self._free_at = 0.0
    self._lock = threading.Lock()

  @property
  def emulated(self) -> bool:
    return self.bytes_per_s > 0 or self.latency_s > 0

  def arrival(self, nbytes: int) -> float:
    """Reserves the link for `nbytes` now; returns the clock time at which they arrive."""
    with self._lock:
      now = self._clock()
      start = max(now, self._free_at)
      self._free_at = start + (nbytes / self.bytes_per_s if self.bytes_per_s else 0.0)
      return self._free_at + self.latency_s

  def transfer(self, nbytes: int) -> float:
    """Blocks until `nbytes` sent now would have arrived; returns the seconds waited."""
    if not self.emulated:
      return 0.0
    wait = self.arrival(nbytes) - self._clock()
    if wait > 0:
      self._sleep(wait)
    return max(wait, 0.0)


def learner_links(store: StoreConfig, learner: int) -> tuple[Link, Link]:
  """(up, down) links of `learner` from the validated `store.wan_mbps`, `store.wan_latency_ms`.

  A list shorter than the learner id repeats its last value (one value applies to all).
  """
  def pick(field: str) -> float:
    values = store.wan_values(field)
    return values[min(learner, len(values) - 1)] if values else 0.0

  rate = pick("wan_mbps")
  latency = pick("wan_latency_ms")
  return Link(rate, latency), Link(rate, latency)
