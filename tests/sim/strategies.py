"""Random simulator traces, shared by the simulator's property tests."""

from __future__ import annotations

from hypothesis import strategies as st

from gpu_arbiter.sim import TraceRequest

PRIORITIES = st.sampled_from([100, 300, 500, 800])
REQUESTS = st.builds(
    lambda at, model, gib, gpus, prio, pre, load, run: TraceRequest(
        arrival_s=at,
        model=f"m{model}",
        vram_mb=gib * 1024,
        run_s=run,
        gpus=gpus,
        priority=prio,
        preemptible=pre,
        load_s=load,
    ),
    st.integers(0, 300).map(float),
    st.integers(0, 4),
    st.integers(1, 24),
    st.integers(1, 2),
    PRIORITIES,
    st.booleans(),
    st.integers(0, 20).map(float),
    st.integers(1, 120).map(float),
)
