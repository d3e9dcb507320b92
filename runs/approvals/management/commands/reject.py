from runs.approvals.management.commands.approve import Command as Approve


class Command(Approve):
    help = "Reject a pending action: the workflow gets ApprovalRejected. Final, recorded."
    decision = "reject"
