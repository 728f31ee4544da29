"""The delivery settings the job lifecycle relies on, as the Celery app is configured."""

import os
import subprocess
import sys

import pytest

from sdq.models.download.settings import DownloadSettings
from sdq.models.generate.settings import GenerateSettings
from sdq.models.jobs.kinds import GENERATE, KINDS, POOL_QUEUES, QUEUES, Pool
from sdq.models.settings import Settings
from sdq.workers.app import create_app


def test_delivery_settings_follow_the_lifecycle() -> None:
    settings = Settings.from_env(
        {
            "SDQ_BROKER_URL": "redis://127.0.0.1:6379/0",
            "SDQ_TASK_TIME_LIMIT": "600",
            "SDQ_TASK_SOFT_TIME_LIMIT": "540",
        }
    )
    app = create_app(settings)
    conf = app.conf
    assert conf.task_serializer == "json" and list(conf.accept_content) == ["json"]
    assert conf.task_acks_late and conf.task_reject_on_worker_lost
    assert conf.worker_prefetch_multiplier == 1
    assert (conf.task_soft_time_limit, conf.task_time_limit) == (540, 600)
    # Redis must not hand a running task to a second worker before the first is killed.
    assert conf.broker_transport_options["visibility_timeout"] > conf.task_time_limit
    assert conf.task_ignore_result
    assert {queue.name for queue in conf.task_queues} == set(QUEUES)
    assert set(QUEUES) == set(POOL_QUEUES[Pool.gpu] + POOL_QUEUES[Pool.cpu])
    assert conf.task_routes[GENERATE.task_name] == {"queue": "generate"}
    app.loader.import_default_modules()
    assert set(KINDS) <= {name.removeprefix("sdq.") for name in app.tasks}


def test_time_limits_differ_per_queue_and_the_visibility_timeout_outlasts_them() -> None:
    settings = Settings.from_env(
        {"SDQ_TASK_TIME_LIMIT": "300", "SDQ_TRAIN_TASK_TIME_LIMIT": "36000"}
    )
    assert (settings.time_limits["generate"].soft, settings.time_limits["generate"].hard) == (
        270,
        300,
    )
    assert settings.time_limits["train"].hard == 36000
    assert settings.time_limits["train"].soft < 36000
    assert settings.visibility_timeout >= 2 * 36000
    app = create_app(settings)
    app.loader.import_default_modules()
    task = app.tasks[GENERATE.task_name]
    assert (task.soft_time_limit, task.time_limit) == (270, 300)


def test_settings_that_cannot_work_are_refused_at_start() -> None:
    # A hard limit alone brings the soft one under it instead of failing every task.
    alone = Settings.from_env({"SDQ_TASK_TIME_LIMIT": "15"})
    assert alone.time_limits["generate"].soft < alone.time_limits["generate"].hard == 15
    with pytest.raises(ValueError, match=r"SDQ_TASK_SOFT_TIME_LIMIT \(30\) must not exceed"):
        Settings.from_env({"SDQ_TASK_TIME_LIMIT": "15", "SDQ_TASK_SOFT_TIME_LIMIT": "30"})


def test_settings_default_to_the_embedded_deployment() -> None:
    settings = Settings.from_env({})
    assert settings.embedded and settings.database_url == "sqlite:///sdq-data/sdq.db"
    assert settings.store_url == "sdq-data/store"
    assert settings.group(GenerateSettings).batch_size == 8 and settings.jobs.max_attempts == 3
    with pytest.raises(ValueError, match="SDQ_MAX_ATTEMPTS must be an integer, got 'three'"):
        Settings.from_env({"SDQ_MAX_ATTEMPTS": "three"})
    # Timeouts take fractions of a second.
    fractional = Settings.from_env({"SDQ_DOWNLOAD_TIMEOUT": "2.5"})
    assert fractional.group(DownloadSettings).read_timeout == 2.5
    with pytest.raises(ValueError, match="SDQ_DOWNLOAD_CONNECT_TIMEOUT must be a number of"):
        Settings.from_env({"SDQ_DOWNLOAD_CONNECT_TIMEOUT": "soon"})
    with pytest.raises(ValueError, match="above 0"):
        Settings.from_env({"SDQ_DOWNLOAD_TIMEOUT": "0"})
    # On or off.
    assert not Settings.from_env({}).group(GenerateSettings).channels_last
    assert Settings.from_env({"SDQ_CHANNELS_LAST": "on"}).group(GenerateSettings).channels_last
    refused = r"SDQ_CHANNELS_LAST must be on or off \(1 or 0\), got 'maybe'"
    with pytest.raises(ValueError, match=refused):
        Settings.from_env({"SDQ_CHANNELS_LAST": "maybe"})


def test_compiled_shapes_are_read_and_checked() -> None:
    compiled = Settings.from_env(
        {"SDQ_COMPILE": "1", "SDQ_COMPILE_BATCHES": "4,1,2", "SDQ_WARM_SHAPES": "512x512,768x640"}
    ).group(GenerateSettings)
    assert compiled.compile_mode == "max-autotune"  # CUDA graphs, where there is CUDA
    assert compiled.compile_batches == (1, 2, 4)
    assert compiled.warm_shapes == ((512, 512), (768, 640))
    assert Settings.from_env({}).group(GenerateSettings).compile_batches == (1, 2, 4, 8, 16)
    with pytest.raises(ValueError, match="SDQ_WARM_SHAPES: '512x51' is not WIDTHxHEIGHT"):
        Settings.from_env({"SDQ_WARM_SHAPES": "512x51"})
    with pytest.raises(ValueError, match="SDQ_COMPILE_BATCHES must be batch sizes"):
        Settings.from_env({"SDQ_COMPILE_BATCHES": "0,2"})


def test_settings_whose_order_makes_no_sense_are_refused_at_start() -> None:
    """A gang given longer to gather than its ranks' rendezvous waits would be given up by
    the ranks first: refused as the settings are read, by every command and worker."""
    with pytest.raises(ValueError, match=r"SDQ_TRAIN_GANG_TIMEOUT \(600\) must be below"):
        Settings.from_env({"SDQ_TRAIN_GANG_TIMEOUT": "600", "SDQ_TRAIN_COLLECTIVE_TIMEOUT": "31"})
    done = subprocess.run(
        [sys.executable, "-m", "sdq.producer.cli", "worker", "gpu"],
        env={**os.environ, "SDQ_TRAIN_GANG_TIMEOUT": "40", "SDQ_TRAIN_COLLECTIVE_TIMEOUT": "31"},
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert done.returncode == 2 and "SDQ_TRAIN_COLLECTIVE_TIMEOUT (31)" in done.stderr
