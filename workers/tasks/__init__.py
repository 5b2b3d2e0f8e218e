"""The Celery side: webhook deliveries, backfill feeding, maintenance (purge, reconciler)."""
