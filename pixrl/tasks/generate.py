from prefect import task

from ..artifacts.tracking import PolicyRef
from ..engines.local import RunSpec
from .common import stage


@task(name="generate", persist_result=False)
def generate(spec: RunSpec, iteration: int, policy: dict) -> dict:
    """G samples per prompt with the given policy version → rows appended to Lance."""
    with stage(spec, "generate", iteration) as st:
        ref, m = st.engine.generate(iteration, PolicyRef(**policy))
        st.record(m)
    return ref.to_dict()
