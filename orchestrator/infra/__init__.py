"""Infrastructure every layer may use: the typed settings (settings), input checks (inputs),
escaping per renderer (escape), the farm's CA and keys (ca, keys), QR codes (qr) and the
embedded broker (fsbroker). Imports nothing else of the orchestrator."""
