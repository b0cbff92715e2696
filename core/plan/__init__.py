"""Method auto: which levels draft and how far, chosen round by round from a cost model and what runs measured."""
