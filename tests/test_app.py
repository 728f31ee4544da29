"""The delivery settings the job lifecycle relies on, as the Celery app is configured."""

import pytest

from models.settings import Settings
from workers.app import CPU_QUEUES, GENERATE_TASK, GPU_QUEUES, QUEUES, create_app


def test_delivery_settings_follow_the_lifecycle() -> None:
    settings = Settings.from_env(
        {
            "SDQ_BROKER_URL": "redis://127.0.0.1:6379/0",
            "SDQ_TASK_TIME_LIMIT": "600",
            "SDQ_TASK_SOFT_TIME_LIMIT": "540",
        }
    )
    conf = create_app(settings).conf
    assert conf.task_serializer == "json" and list(conf.accept_content) == ["json"]
    assert conf.task_acks_late and conf.task_reject_on_worker_lost
    assert conf.worker_prefetch_multiplier == 1
    assert (conf.task_soft_time_limit, conf.task_time_limit) == (540, 600)
    # Redis must not hand a running task to a second worker before the first is killed.
    assert conf.broker_transport_options["visibility_timeout"] > conf.task_time_limit
    assert conf.task_ignore_result
    assert {queue.name for queue in conf.task_queues} == set(QUEUES) == set(GPU_QUEUES + CPU_QUEUES)
    assert conf.task_routes[GENERATE_TASK] == {"queue": "generate"}


def test_settings_default_to_the_embedded_deployment() -> None:
    settings = Settings.from_env({})
    assert settings.embedded and settings.database_url == "sqlite:///sdq-data/sdq.db"
    assert settings.store_url == "sdq-data/store"
    with pytest.raises(ValueError, match="SDQ_MAX_ATTEMPTS must be an integer, got 'three'"):
        Settings.from_env({"SDQ_MAX_ATTEMPTS": "three"})
