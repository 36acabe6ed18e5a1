"""COCO data: schema and rules, Arrow shards, image decoding, geometry, augmentation, the cache, the loader, sampler, streaming and fetching."""
