"""Process and redis-server plumbing shared by the tests, the benchmarks and the demo.

Not part of the library (it is not packaged): development tools of this
repository. It imports nothing from ``tests`` so that ``python -m
example_project.demo`` works on a fresh clone without the test suite.

* :mod:`harness.processes`: child processes that never outlive their parent
  (``PR_SET_PDEATHSIG`` on Linux), each the leader of its own process group,
  with their output in a log file; stopping one sweeps its whole group.
* :mod:`harness.redis_server`: a ``redis-server`` we started on a free
  loopback port, accepted only once the server answering on that port reports
  our child's pid (``INFO server``); if another program took the port first,
  the server is started again on a new one.
* :mod:`harness.rabbitmq_server`: a RabbitMQ node (Debian's ``rabbitmq-server``)
  on free loopback ports, its files in a temporary directory of its own,
  accepted once an AMQP login reaches our node.
* :mod:`harness.waiting`: polling a condition with a deadline.
* :mod:`harness.proxy`: a TCP proxy on loopback that delays, holds or cuts one
  server's connections.
* :mod:`harness.sentinel`: a Redis Sentinel's configuration, and when a watched
  group is ready.
* :mod:`harness.chaos`: ``make chaos``, the cluster under overlapping faults and a
  checker that judges its whole history.
"""

from .processes import ChildProcess, ProcessError, die_with_parent, group_alive, signal_group
from .rabbitmq_server import RabbitMQServerProcess, find_rabbitmq_server
from .redis_server import RedisServerProcess, find_redis_server, free_port, server_pid
from .waiting import wait_until

__all__ = [
    "ChildProcess",
    "ProcessError",
    "RabbitMQServerProcess",
    "RedisServerProcess",
    "die_with_parent",
    "find_rabbitmq_server",
    "find_redis_server",
    "free_port",
    "group_alive",
    "server_pid",
    "signal_group",
    "wait_until",
]
