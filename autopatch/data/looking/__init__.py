"""How autopatch looks at a user's samples without changing training: on a side copy of the
dataset, under fixed seeds whose states are put back, loaded as the user's loader would."""
