"""The steps no longer need an index on what they spent: the spend pages read SpendDay (0023)."""

from django.db import migrations


class Migration(migrations.Migration):
    dependencies = [
        ("runs", "0023_spend_days"),
    ]

    operations = [
        migrations.RemoveIndex(
            model_name="step",
            name="runs_step_spent_idx",
        ),
    ]
