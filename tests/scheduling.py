"""How ``make test`` deals the tests out to its pytest-xdist workers (conftest's
``pytest_xdist_make_scheduler``, with ``-n N --dist loadscope --no-loadscope-reorder``).

One test at a time, in the order of conftest's sorted collection, so each worker switches Spark
sessions in the same order and a worker that is free takes the next test; but:

- the files of the heaviest sessions (``ONE_WORKER_FILES``: a standalone cluster's daemons, two
  network-namespace hosts, a Connect server) go to one worker in all, one after the other (run
  together on 2 cores, their fallback deadlines were missed), and each of ``WHOLE_FILES`` to one
  worker (DeepSpeed compiles its CPU op once, not a second worker waiting on its build lock);
- with 3 workers or more, the last one is the **waiting lane**: it runs the files whose tests
  mostly wait (``WAITING_FILES``: stall and timeout deadlines that must pass, ranks that must stay
  quiet for seconds, connections cut after idle pauses; measured: their process trees used 0.01-0.22
  s of CPU per second), then the heaviest sessions' files (which come last in the order), and
  nothing else, while the other workers run the rest. On 2 cores two workers keep the CPU busy;
  a third that mostly sleeps fills the cores' idle time instead of adding to their load, and the
  heavy sessions no longer run alone at the end.

pytest-xdist's ``loadgroup`` would read ``xdist_group`` marks, but with pytest 9 the group suffix it
adds to a test's id is lost (every test became its own group), so the scopes are named here.
"""

from __future__ import annotations

from typing import Any

#: the test files of the heaviest sessions: one worker runs them all
ONE_WORKER_FILES = frozenset({"test_standalone.py", "test_two_hosts.py", "test_connect.py"})
#: files whose tests go to one worker together
WHOLE_FILES = frozenset({"test_integrations.py"})
#: files whose tests mostly wait (wall time several times their CPU time): the waiting lane's
WAITING_FILES = frozenset(
    {"test_stall.py", "test_flight_recorder.py", "test_channel_faults.py", "test_progress_frames.py"}
)
#: the fewest workers with a waiting lane (with fewer, every worker takes every kind of test)
LANE_WORKERS = 3


def file_of(nodeid: str) -> str:
    """The test file's name of a pytest node id."""
    return nodeid.split("::", 1)[0].rsplit("/", 1)[-1]


def scope_of(nodeid: str) -> str:
    """The unit of work a test belongs to: a group of files, a whole file, or the test alone."""
    name = file_of(nodeid)
    if name in ONE_WORKER_FILES:
        return "one-worker"
    return name if name in WHOLE_FILES else nodeid


def in_waiting_lane(scope: str) -> bool:
    """The waiting lane's work: the waiting files, then (they come last in the order) the heaviest
    sessions' files, which its worker runs while the others are still busy instead of after them."""
    return scope == "one-worker" or file_of(scope) in WAITING_FILES


def make_scheduler(config: Any, log: Any) -> Any:
    """The scheduler of a ``--dist loadscope`` run (None for any other distribution mode)."""
    if config.getvalue("dist") != "loadscope":
        return None
    from xdist.scheduler import LoadScopeScheduling

    class SuiteScheduling(LoadScopeScheduling):  # type: ignore[misc]
        def _split_scope(self, nodeid: str) -> str:
            return scope_of(nodeid)

        def _waiting_lane(self) -> Any:
            """The worker that runs only the waiting files (None: no lanes in this run), chosen
            once: workers leave the scheduler as they finish, the lanes stay as they were."""
            if not hasattr(self, "_lane"):
                nodes = sorted(self.nodes, key=lambda node: int(node.gateway.id.removeprefix("gw")))
                self._lane = nodes[-1] if len(nodes) >= LANE_WORKERS else None
            if self._lane is not None and self._lane not in self.nodes:  # it crashed: one lane again
                self._lane = None
            return self._lane

        def _next_scope(self, node: Any) -> str | None:
            lane = self._waiting_lane()
            if lane is None:
                return next(iter(self.workqueue), None)
            waits = node is lane
            for scope in self.workqueue:
                if in_waiting_lane(scope) is waits:
                    return scope
            return None

        def _assign_work_unit(self, node: Any) -> None:
            scope = self._next_scope(node)
            if scope is None:  # nothing left in this worker's lane
                if not node.shutting_down:
                    node.shutdown()
                return
            self.workqueue.move_to_end(scope, last=False)  # pytest-xdist assigns the queue's first unit
            super()._assign_work_unit(node)

    return SuiteScheduling(config, log)
