"""How the worker runs workflow code: outside the SDK's sandbox.

The sandbox re-imports a workflow's module for every run it starts, keeps the
copy for as long as the run is cached, and wraps every activation in its own
globals and import hooks. Measured with the benchmark's own runs (bench/README,
"Where the time goes now"), that was about a fifth to a third of the worker's
CPU per run and some 70 KiB of every waiting run's memory, for checks that no
longer watch most of our workflow code: the run's helpers, models and
activities' types are passed through it already, where it does not look.

What the sandbox checked is checked elsewhere, for all of workflows/ and not
only for the code paths a run happens to take:
- tests/test_workflow_determinism.py reads every module under workflows/: no
  clock, randomness, I/O, threads or environment; no state shared between
  runs (unsandboxed, a module is shared by every run in the worker);
- every workflow a test starts replays in the strict sandbox
  (``strict_runner``) when its test ends (tests/workflow_harness.py), and
  tests/test_replay.py replays every recorded history on this runner and on
  the strict sandbox, whose restrictions fail a replay that reaches a
  forbidden call in a workflow module's own code.
"""

from __future__ import annotations

from temporalio.worker import UnsandboxedWorkflowRunner, WorkflowRunner
from temporalio.worker.workflow_sandbox import SandboxedWorkflowRunner


def workflow_runner() -> WorkflowRunner:
    """The runner the worker (and the replay tests) use."""
    return UnsandboxedWorkflowRunner()


def strict_runner() -> WorkflowRunner:
    """The SDK's default sandbox, for the replay tests: every restriction on,
    the workflow module imported afresh for each run."""
    return SandboxedWorkflowRunner()
