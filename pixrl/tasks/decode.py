from prefect import task

from ..artifacts.trajectories import TableRef
from ..engines.local import RunSpec
from .common import stage


@task(name="decode", persist_result=False)
def decode(spec: RunSpec, iteration: int, table: dict) -> dict:
    """VAE-decode final latents → PNG bytes in the `image` column."""
    with stage(spec, "decode", iteration) as st:
        ref, m = st.engine.decode(iteration, TableRef(**table))
        st.record(m)
    return ref.to_dict()
