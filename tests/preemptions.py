"""Which requests a test's engine preempts."""

from __future__ import annotations


def record_preemptions(llm) -> list[str]:
    """The ids of the requests `llm`'s scheduler preempts from now on, in order."""
    preempted: list[str] = []
    preempt = llm.engine.scheduler._preempt

    def recording(request, output):
        preempted.append(request.request_id)
        return preempt(request, output)

    llm.engine.scheduler._preempt = recording
    return preempted
