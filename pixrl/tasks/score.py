from prefect import task

from ..artifacts.trajectories import TableRef
from ..engines.local import RunSpec
from .common import stage


@task(name="score", persist_result=False)
def score(spec: RunSpec, iteration: int, table: dict) -> dict:
    """Configured rewards → per-component and total reward columns; fails loud on NaN/missing."""
    with stage(spec, "score", iteration) as st:
        ref, m = st.engine.score(iteration, TableRef(**table))
        st.record(m)
    return ref.to_dict()
