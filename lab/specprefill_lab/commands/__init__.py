"""The lab's commands, which join ``specprefill``'s own through the ``specprefill.commands`` entry points."""
