from prefect import task

from ..artifacts.trajectories import TableRef
from ..artifacts.tracking import PolicyRef
from ..engines.local import BatchPlan, RunSpec
from .common import stage


@task(name="update", persist_result=False)
def update(spec: RunSpec, iteration: int, replayed: dict, policy: dict) -> dict:
    """Replay stored transitions through the current model, PPO-clip loss, optimizer steps → checkpoint."""
    with stage(spec, "update", iteration) as st:
        ck, m = st.engine.update(iteration, TableRef(**replayed["table"]), BatchPlan(**replayed["plan"]),
                              PolicyRef(**policy))
        st.record(m)
    return ck.to_dict()
