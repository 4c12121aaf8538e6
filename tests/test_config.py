"""Bad options and settings are clear errors at registration or start-up."""

from __future__ import annotations

from collections.abc import Iterator
from types import SimpleNamespace

import pytest
from celery import Celery
from celery.exceptions import ImproperlyConfigured

from celery_singleton_beat import SingletonTask
from celery_singleton_beat.config import SingletonSettings, get_settings, validate_settings

from .support import CeleryProcess, RedisServer, child_env


@pytest.fixture
def app() -> Iterator[Celery]:
    app = Celery("cfg", broker="memory://", set_as_current=False)
    app.conf.singleton_redis_url = "redis://127.0.0.1:1/0"
    yield app


@pytest.mark.parametrize(
    ("options", "option", "detail"),
    [
        ({"lock_mode": "forever"}, "lock_mode", "while_executing, until_executed, until_executing"),
        ({"on_conflict": "ignore"}, "on_conflict", "skip, raise, retry"),
        ({"lock_ttl": 0}, "lock_ttl", "> 0"),
        ({"lock_ttl": -5}, "lock_ttl", "> 0"),
        ({"lock_ttl": "60"}, "lock_ttl", "> 0"),
        ({"unique_on": ["customer"]}, "unique_on", "'customer', which is not a parameter"),
        ({"unique_on": "customer_id"}, "unique_on", "list of argument names"),
    ],
)
def test_bad_task_options_fail_at_registration_naming_task_and_option(
    app: Celery, options: dict, option: str, detail: str
) -> None:
    with pytest.raises(ImproperlyConfigured) as info:
        @app.task(base=SingletonTask, name="proj.sync", shared=False, **options)
        def sync(customer_id: int, verbose: bool = False) -> None: ...

        app.finalize()
    message = str(info.value)
    assert "task proj.sync" in message and option in message and detail in message


def test_good_options_register(app: Celery) -> None:
    @app.task(base=SingletonTask, unique_on=["customer_id"], lock_ttl=5, lock_mode="until_executed",
              on_conflict="raise", shared=False)
    def sync(customer_id: int, verbose: bool = False) -> None: ...

    app.finalize()
    task = app.tasks[sync.name]
    assert task.effective_lock_ttl == 5.0


@pytest.mark.parametrize(
    ("options", "message"),
    [
        ({"uniqe_on": ["customer_id"]}, "unknown option uniqe_on; did you mean unique_on?"),
        ({"lock_tll": 5}, "unknown option lock_tll; did you mean lock_ttl?"),
        ({"lockttl": 5}, "unknown option lockttl; did you mean lock_ttl?"),
        ({"Lock_TTL": 5}, "unknown option Lock_TTL; did you mean lock_ttl?"),
        ({"on_conflcit": "raise"}, "unknown option on_conflcit; did you mean on_conflict?"),
        ({"lock_modes": "until_executed"}, "unknown option lock_modes; did you mean lock_mode?"),
        ({"unique_onn": []}, "unknown option unique_onn; did you mean unique_on?"),
        # The peers' names, for a team switching from them (docs/migrating.md).
        ({"lock_expiry": 600}, "lock_expiry is celery-singleton's option; did you mean lock_ttl?"),
        ({"raise_on_duplicate": True}, "raise_on_duplicate is celery-singleton's option; "
                                       "did you mean on_conflict='raise'?"),
        ({"once": {"graceful": True}}, "once is celery-once's option; did you mean lock_mode="),
    ],
)
def test_a_misspelt_singleton_option_fails_at_registration_with_a_suggestion(
    app: Celery, options: dict, message: str
) -> None:
    """Issue 22: ``@app.task(base=SingletonTask, uniqe_on=[...], lock_tll=5)`` was accepted and ignored."""
    with pytest.raises(ImproperlyConfigured) as info:
        @app.task(base=SingletonTask, name="proj.sync", shared=False, **options)
        def sync(customer_id: int, verbose: bool = False) -> None: ...

        app.finalize()
    assert str(info.value).startswith("task proj.sync: ") and message in str(info.value)


@pytest.mark.parametrize("ttl", [0, -1, True, "5", float("inf"), float("nan")])
def test_a_lock_ttl_that_is_not_a_finite_positive_number_fails_at_registration(app: Celery, ttl: object) -> None:
    """Not left to the first run: an infinite or NaN lease passed the check and every run then
    failed converting it to milliseconds (``OverflowError``, ``ValueError``)."""
    with pytest.raises(ImproperlyConfigured, match=r"^task proj.sync: lock_ttl must be a number of seconds > 0"):
        @app.task(base=SingletonTask, name="proj.sync", shared=False, lock_ttl=ttl)
        def sync(customer_id: int) -> None: ...

        app.finalize()


def test_checking_options_leaves_the_base_class_unbound(app: Celery) -> None:
    """Looking at a task's attributes must not bind ``SingletonTask`` itself to an app
    (``Task.app`` is a property that does): every later task would inherit that app's
    ``acks_late``, ``store_eager_result``, ... instead of reading its own app's."""
    @app.task(base=SingletonTask, name="proj.sync", shared=False, queue="q", lock_name="x")
    def sync(customer_id: int) -> None: ...

    app.finalize()
    assert "_app" not in vars(SingletonTask) and "acks_late" not in vars(SingletonTask)


def test_a_misspelt_option_of_a_task_class_fails_too(app: Celery) -> None:
    class Base(SingletonTask):
        lock_tll = 5

    with pytest.raises(ImproperlyConfigured, match=r"unknown option lock_tll; did you mean lock_ttl\?"):
        @app.task(base=Base, name="proj.sync", shared=False)
        def sync(customer_id: int) -> None: ...

        app.finalize()


def test_celery_options_and_own_attributes_are_not_taken_for_typos(app: Celery) -> None:
    """Celery's own task options, and attributes of a user's own that are more than one
    typo away from an option name, register (and keep their values)."""
    celery_options = {
        "max_retries": 5, "default_retry_delay": 1, "acks_late": True, "acks_on_failure_or_timeout": True,
        "reject_on_worker_lost": True, "autoretry_for": (ValueError,), "retry_backoff": True, "retry_backoff_max": 10,
        "retry_jitter": False, "rate_limit": "10/m", "time_limit": 30, "soft_time_limit": 20, "ignore_result": True,
        "store_errors_even_if_ignored": True, "track_started": True, "typing": True, "serializer": "json",
        "queue": "singles", "priority": 3, "expires": 60, "trail": False, "throws": (KeyError,),
        "store_eager_result": True, "resultrepr_maxsize": 512,
    }
    own = {"lock_name": "sync", "lock_key": "k", "unique_id": "c", "lock_timeout": 5, "conflicts": 0,
           "ttl": 3, "mode": "x", "uniq": True, "lock_owner": "team-a"}

    @app.task(base=SingletonTask, name="proj.sync", shared=False, unique_on=["customer_id"], lock_ttl=5,
              bind=True, **celery_options, **own)
    def sync(self: SingletonTask, customer_id: int) -> None: ...

    app.finalize()
    task = app.tasks["proj.sync"]
    assert all(getattr(task, name) == value for name, value in {**celery_options, **own}.items())
    for name in dir(Celery("probe", set_as_current=False).Task):  # every attribute Celery's Task has
        if not name.startswith("_"):
            SingletonTask._singleton_looking(name) is None or pytest.fail(f"Celery's {name} taken for a typo")


@pytest.mark.parametrize(
    ("setting", "value", "message"),
    [
        ("singleton_redis_url", "amqp://guest@localhost//", "must be a Redis URL"),
        ("singleton_lock_ttl", 0, "singleton_lock_ttl must be a number of seconds > 0"),
        # A lease of "forever" or NaN cannot be written as PX (it failed at the first acquire).
        ("singleton_lock_ttl", float("inf"), "singleton_lock_ttl must be a number of seconds > 0"),
        ("singleton_liveness_ttl", float("nan"), "singleton_liveness_ttl must be a number of seconds > 0"),
        ("singleton_lock_tll", 10, "unknown setting singleton_lock_tll; did you mean singleton_lock_ttl?"),
        ("singleton_fail_open", "yes", "singleton_fail_open must be True or False"),
        ("singleton_key_prefix", "a{b}", "singleton_key_prefix must be a non-empty string"),
        ("singleton_redis_options", [1], "singleton_redis_options must be a dict"),
        ("singleton_beat_catch_up", "all", "singleton_beat_catch_up must be 'latest' or 'none'"),
        ("singleton_beat_catch_up_window", 0, "singleton_beat_catch_up_window must be a number of seconds > 0"),
    ],
)
def test_bad_settings_are_named(app: Celery, setting: str, value: object, message: str) -> None:
    app.conf[setting] = value
    with pytest.raises(ImproperlyConfigured, match=message.replace("?", r"\?")):
        validate_settings(app)


def test_redis_url_falls_back_to_the_result_backend_then_the_broker() -> None:
    app = Celery("fb", broker="redis://broker:6379/0", backend="redis://backend:6379/1", set_as_current=False)
    assert get_settings(app).redis_url == "redis://backend:6379/1"
    app2 = Celery("fb2", broker="redis://broker:6379/0", backend="rpc://", set_as_current=False)
    assert get_settings(app2).redis_url == "redis://broker:6379/0"


def test_settings_under_a_namespace_are_read() -> None:
    """``config_from_object(..., namespace="CELERY")`` (how Django projects load Celery's
    settings): CELERY_SINGLETON_* are the library's settings, typos included."""
    django_like = SimpleNamespace(CELERY_BROKER_URL="redis://127.0.0.1:1/0",
                                  CELERY_SINGLETON_REDIS_URL="redis://127.0.0.1:2/5",
                                  CELERY_SINGLETON_BEAT_CATCH_UP="none")
    app = Celery("cfg", set_as_current=False)
    app.config_from_object(django_like, namespace="CELERY")
    settings = validate_settings(app)
    assert settings.redis_url == "redis://127.0.0.1:2/5"
    assert settings.beat_catch_up == "none"

    django_like.CELERY_SINGLETON_BEAT_CATCHUP = "none"
    typo = Celery("cfg", set_as_current=False)
    typo.config_from_object(django_like, namespace="CELERY")
    with pytest.raises(ImproperlyConfigured, match="CELERY_SINGLETON_BEAT_CATCHUP"):
        validate_settings(typo)


def test_no_redis_anywhere_is_a_clear_error() -> None:
    app = Celery("none", broker="amqp://", backend="rpc://", set_as_current=False)
    with pytest.raises(ImproperlyConfigured, match="set singleton_redis_url"):
        get_settings(app)


def test_defaults() -> None:
    settings = SingletonSettings()
    assert (settings.lock_ttl, settings.key_prefix, settings.fail_open) == (60.0, "singleton", False)


def test_worker_refuses_to_start_with_a_bad_setting(redis_server: RedisServer, tmp_path) -> None:
    """The worker exits at start-up with the setting's name, before taking any task."""
    (tmp_path / "badapp.py").write_text(
        "from celery import Celery\n"
        "from celery_singleton_beat import SingletonTask\n"
        f"app = Celery('badapp', broker='{redis_server.url(0)}')\n"
        "app.conf.singleton_redis_url = 'amqp://localhost//'\n"
        "@app.task(base=SingletonTask)\n"
        "def job(x):\n    return x\n"
    )
    env = child_env(redis_server)
    env["PYTHONPATH"] = f"{tmp_path}:{env['PYTHONPATH']}"
    worker = CeleryProcess(["-A", "badapp", "worker", "-P", "solo", "--without-mingle",
                            "--without-gossip", "--without-heartbeat"], env, name="bad").start()
    assert worker.process is not None
    code = worker.process.wait(60)
    assert code != 0
    assert "singleton_redis_url must be a Redis URL" in worker.output()
