"""Site-side inference after training: the FedSM super model (``fedsm``) and IOP-FL test-time routing
(``routing``). Pure PyTorch over models and datasets; the FLARE sites call them, reports read their results."""
