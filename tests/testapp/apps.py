from django.apps import AppConfig


class TestAppConfig(AppConfig):
    """The tests' own stand-in for the outside world: the ledger their workflows write to."""

    name = "tests.testapp"
    label = "testapp"
    default_auto_field = "django.db.models.BigAutoField"
