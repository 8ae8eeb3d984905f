"""``/v1/job_types``: the job types this server trains (engine.spec.config.JOB_TYPES), for clients that build specs,
such as the dashboard's new-job form: what each reads and makes, its default hyperparameters, its headline
metrics, and the built-in datasets it can train on."""

from fastapi import APIRouter

from api.deps import CurrentProject
from api.schemas import JobTypePublic, JobTypesPublic
from engine.builtin import DATASETS
from engine.spec.config import JOB_TYPES
from engine.spec.rows import dataset_kind

router = APIRouter(prefix="/job_types", tags=["jobs"])


@router.get("")
def list_job_types(_project: CurrentProject) -> JobTypesPublic:
    """Every job type, in the order the server lists them."""
    data = []
    for name, info in JOB_TYPES.items():
        builtin = [f"builtin:{d}" for d, (kind, _) in DATASETS.items() if dataset_kind(kind) == info.dataset]
        data.append(
            JobTypePublic(
                name=name,
                summary=info.summary,
                dataset_kind=info.dataset,
                output=info.output,
                generates=info.generates,
                reward_model=info.reward_model,
                metrics=list(info.metrics),
                hyperparameters=info.config().model_dump(mode="json"),
                builtin_datasets=builtin,
                example=info.demo,
            )
        )
    return JobTypesPublic(data=data)
