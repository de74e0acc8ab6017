from prefect import task

from ..artifacts.trajectories import TableRef
from ..engines.local import RunSpec
from .common import stage


@task(name="replay", persist_result=False)
def replay(spec: RunSpec, iteration: int, table: dict) -> dict:
    """Group advantages → `advantage` column; the training micro-batches as sample ids."""
    with stage(spec, "replay", iteration) as st:
        ref, plan, m = st.engine.replay(iteration, TableRef(**table))
        st.record(m)
    return {"table": ref.to_dict(), "plan": plan.to_dict()}
