"""Work that runs while a lock Redis fails over: two singleton beats and a stream of tasks.

Used by the Sentinel failover tests: the beats (in the test process, a slot every
0.5 s) and the publisher each run on a thread of their own until ``stop`` is set.
"""

from __future__ import annotations

import random
import threading
from dataclasses import dataclass, field
from types import ModuleType

from celery.result import AsyncResult

from .beat import RealClock, RecordingScheduler, beat_app, beat_loop

#: The keys the stream of tasks publishes on, in random order.
HOT_KEYS = ("hot0", "hot1", "hot2")


@dataclass
class FailoverLoad:
    """Two beats of ``tick`` every 0.5 s on the lock Redis at ``url`` and ``tasks.work`` on
    :data:`HOT_KEYS` every 0.1 s (0.5 s runs), until ``stop`` is set."""

    tasks: ModuleType
    url: str
    seed: int
    stop: threading.Event = field(default_factory=threading.Event)
    published: list[AsyncResult] = field(default_factory=list)
    beat_errors: list[str] = field(default_factory=list)
    beats: list[RecordingScheduler] = field(default_factory=list)
    threads: list[threading.Thread] = field(default_factory=list)

    def __post_init__(self) -> None:
        fast = {"socket_timeout": 1.0, "socket_connect_timeout": 1.0}
        clock = RealClock()
        self.beats = [RecordingScheduler(app=beat_app(clock, {"tick": {"task": "t.tick", "schedule": 0.5}}, self.url,
                                                      singleton_redis_options=fast))
                      for _ in range(2)]
        self.threads = [threading.Thread(target=beat_loop, args=(beat, self.stop, self.beat_errors))
                        for beat in self.beats]
        self.threads.append(threading.Thread(target=self._publish))

    def _publish(self) -> None:
        # Keys in random order: two runs of one key are often due at once (round-robin
        # over 3 keys with 3 free pool processes would never put one key in two of them).
        keys = random.Random(self.seed)
        i = 0
        while not self.stop.is_set():
            self.published.append(self.tasks.work.delay(f"hot{keys.randrange(len(HOT_KEYS))}", 0.5, note=str(i)))
            i += 1
            self.stop.wait(0.1)

    def start(self) -> None:
        for thread in self.threads:
            thread.start()

    def finish(self) -> None:
        """Stop publishing and sending; wait for the threads."""
        self.stop.set()
        for thread in self.threads:
            if thread.is_alive():
                thread.join(30)

    def close(self) -> None:
        self.finish()
        for beat in self.beats:
            beat.close()
