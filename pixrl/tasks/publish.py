from prefect import task

from ..artifacts.checkpoints import CheckpointRef
from ..engines.local import RunSpec
from .common import stage


@task(name="publish", persist_result=False)
def publish(spec: RunSpec, iteration: int, checkpoint: dict) -> dict:
    """Checkpoint → MLflow artifact + registered version; alias `rollout` moves last."""
    with stage(spec, "publish", iteration) as st:
        ref, m = st.engine.publish(iteration, CheckpointRef(**checkpoint))
        st.record(m)
    return ref.to_dict()
