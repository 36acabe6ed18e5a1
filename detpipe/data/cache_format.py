"""The augmentation cache on disk: its Arrow schemas and format version, and writing it (one record batch
per image in shards of ~``augment.shard_mb`` MB, plus an index of every column but the pixels). The loader
that reads it is `detpipe.data.dataset`."""
from __future__ import annotations

import logging
from pathlib import Path

import pyarrow as pa
import pyarrow.ipc as ipc

from detpipe.core.errors import StageError

log = logging.getLogger("detpipe.data.cache_format")

SPLITS = ("train", "val")
INDEX_FILE = "index.arrow"
CACHE_FORMAT = 4  # 3: masks column; 4: encoding (schema metadata), shard_mb
# Fill of the zoom-out canvas (written into the cache's pixels): the ImageNet mean in 0..255, as in torchvision's references/detection/presets.py.
ZOOM_OUT_FILL = (123, 117, 104)

CACHE_SCHEMA = pa.schema([
    ("image_id", pa.int64()),
    ("variant", pa.int32()),
    ("height", pa.int32()),
    ("width", pa.int32()),
    ("orig_height", pa.int32()),
    ("orig_width", pa.int32()),
    ("scale_y", pa.float64()),
    ("scale_x", pa.float64()),
    ("offset_y", pa.float64()),
    ("offset_x", pa.float64()),
    ("boxes", pa.list_(pa.list_(pa.float32(), 4))),
    ("labels", pa.list_(pa.int64())),
    ("masks", pa.list_(pa.binary())),
    ("pixels", pa.binary()),
])
INDEX_SCHEMA = pa.schema([f for f in CACHE_SCHEMA if f.name not in ("pixels", "masks")]
                         + [pa.field("has_masks", pa.bool_()), pa.field("shard", pa.string()),
                            pa.field("batch", pa.int32())])


class ShardWriter:
    """Writes cache rows, one record batch each, into ``part-NNNNN.arrow`` files of about ``shard_bytes`` stored
    pixel bytes (a new shard starts only between images), and collects the index rows."""

    def __init__(self, out_dir: Path, shard_bytes: int = 32 * 10**6, encoding: str = "raw"):
        self.out_dir, self.index, self.bytes, self.writer, self.batch = out_dir, 0, 0, None, 0
        self.shard_bytes = shard_bytes
        self.schema = CACHE_SCHEMA.with_metadata({"encoding": encoding})
        self.shards: list[str] = []
        self.index_rows: list[dict] = []

    def write_image(self, rows: list[dict]) -> None:
        """Write one image's rows (its variants) into the current shard, starting a new one first if full."""
        if self.writer is None or self.bytes >= self.shard_bytes:
            self.close()
            name = f"part-{self.index:05d}.arrow"
            self.writer = ipc.new_file(str(self.out_dir / name), self.schema)
            self.shards.append(name)
            self.index += 1
        for row in rows:
            self._write(row)

    def _write(self, row: dict) -> None:
        arrays = [pa.array([row[f.name]], type=f.type) for f in CACHE_SCHEMA]
        self.writer.write_batch(pa.RecordBatch.from_arrays(arrays, schema=self.schema))
        self.index_rows.append({**{k: v for k, v in row.items() if k not in ("pixels", "masks")},
                                "has_masks": row["masks"] is not None, "shard": self.shards[-1],
                                "batch": self.batch})
        self.batch += 1
        self.bytes += len(row["pixels"])

    def close(self) -> None:
        if self.writer is not None:
            self.writer.close()
            self.writer, self.bytes, self.batch = None, 0, 0

    def write_index(self, path: Path) -> None:
        """Write the collected index rows as one Arrow IPC file (`INDEX_SCHEMA`)."""
        cols = {f.name: [r[f.name] for r in self.index_rows] for f in INDEX_SCHEMA}
        arrays = [pa.array(cols[f.name], type=f.type) for f in INDEX_SCHEMA]
        schema = INDEX_SCHEMA.with_metadata(self.schema.metadata)
        with ipc.new_file(str(path), schema) as w:
            w.write_table(pa.Table.from_arrays(arrays, schema=schema))
