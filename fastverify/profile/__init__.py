"""``fastverify profile``: the verify step split into compute and all-reduce time.

:mod:`~fastverify.profile.command` (the subcommand), :mod:`~fastverify.profile.build` (the
document, assembled and written), :mod:`~fastverify.profile.record` (the typed record, its bounds
and the view ``tune`` reads), :mod:`~fastverify.profile.table` (the terminal table),
:mod:`~fastverify.profile.plot` (the PNG) and :mod:`~fastverify.profile.painter` (the PNG drawn in
a helper process).
"""
