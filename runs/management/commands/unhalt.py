from runs.management.commands.halt import Command as Halt
from runs.operations import unhalt


class Command(Halt):
    help = "Lift a halt (a person with the unhalt permission, with a reason)."
    action = staticmethod(unhalt)
    verb = "unhalted"
