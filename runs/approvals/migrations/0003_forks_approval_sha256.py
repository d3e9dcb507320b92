"""What an approval approved, as a digest (issue 47 §1): a fork reuses an approval only if its
code asks for the same action. Requests made before are given theirs from what they recorded,
so a fork of a run approved before the upgrade still finds its approval standing."""

from django.db import migrations, models

from runs.approvals.models import approved_digest


def backfill(apps, schema_editor):
    Request = apps.get_model("approvals", "ApprovalRequest")
    asked = Request.objects.filter(kind="action", sha256="").select_related("run")
    batch = []
    for request in asked.only(
        "id", "step_key", "action", "summary", "payload", "run__workflow"
    ).iterator(chunk_size=2000):
        request.sha256 = approved_digest(
            request.run.workflow, request.step_key, request.action, request.summary,
            request.payload,
        )  # fmt: skip
        batch.append(request)
        if len(batch) == 2000:
            Request.objects.bulk_update(batch, ["sha256"])
            batch = []
    Request.objects.bulk_update(batch, ["sha256"])


class Migration(migrations.Migration):
    dependencies = [
        ("approvals", "0002_exact_json"),
    ]

    operations = [
        migrations.AddField(
            model_name="approvalrequest",
            name="sha256",
            field=models.CharField(blank=True, default="", max_length=64),
        ),
        migrations.RunPython(backfill, migrations.RunPython.noop, elidable=True),
    ]
