"""Planning: what goes to the backend for one request, priced. The request's options (``policy``), the draft's
scores (``draft``, ``scores``, ``score_cache``), the selection rule's candidates priced by the cost models
(``costs``) against the engines' caches (``planner``), the replica it goes to (``routing``), the start-up
probe (``calibration``) and warming recurring contexts (``warming``). Its product is a frozen ``plan.Plan``."""
