"""Which fusion mode runs each optimizer, and the machinery around one optimizer's steps.

``controller`` composes, per optimizer: ``interception`` (its step hooks), ``eligibility`` (may a
mode run, and why not), ``chooser`` (the phases that decide: watch, measure, settle), ``active``
(the one holder of the strategy) and ``guard`` (autopatch's own failures fall back to unpatched).
Mode auto's measuring is ``auto`` and ``race``; the watch over the first steps is ``watch``; mode
forward's global patches are ``forward_reads``. The strategies themselves live in fusion/.
"""
