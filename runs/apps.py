from django.apps import AppConfig


class RunsConfig(AppConfig):
    name = "runs"
    default_auto_field = "django.db.models.BigAutoField"

    def ready(self) -> None:
        from django.conf import settings
        from django.db.models.signals import post_save

        from runs import conf

        conf.apply_defaults(settings)  # a project embedding Stepguard sets only what it changes
        _partials_everywhere(settings)

        # The built-in stepguard.notify; the login stamps and the lockout audit events.
        from runs import notifications, security  # noqa: F401
        from runs.logcontext import log_event

        post_save.connect(log_event, sender="runs.Event", dispatch_uid="stepguard-log-event")

        from django.db.backends.signals import connection_created

        from runs.engine.pooling import on_connect

        connection_created.connect(on_connect, dispatch_uid="stepguard-pooler-probe")


def _partials_everywhere(settings) -> None:
    """Django 6 has `{% partialdef %}` built in; on 5.2 django-template-partials' tags become
    builtins too, so the templates load nothing and read the same on both."""
    import django

    if django.VERSION >= (6, 0):
        return
    library = "template_partials.templatetags.partials"
    for config in settings.TEMPLATES:
        if config["BACKEND"].endswith("DjangoTemplates"):
            builtins = config.setdefault("OPTIONS", {}).setdefault("builtins", [])
            if library not in builtins:
                builtins.append(library)
    import django.template

    # The engines may have been built already (they cache settings.TEMPLATES): again, then.
    if hasattr(django.template.engines, "templates"):
        del django.template.engines.templates
    django.template.engines._engines = {}
