//! Failures are clean: a full store, a broken or truncated export, a layered stream and a
//! cancel each end with the right error and leave no file in the store.

use std::io::{self, Read};
use std::path::Path;
use std::process::Command;
use std::sync::atomic::{AtomicBool, Ordering};

use ongrid_images::FreezeError;

use crate::fixture::*;

/// A small tar of `files` incompressible files of `size` bytes each.
fn noisy_tar(files: usize, size: usize) -> Vec<u8> {
    let entries: Vec<Entry> = (0..files)
        .map(|i| Entry {
            path: format!("data/blob-{i}"),
            kind: Kind::File(noise(size, i as u64 + 100)),
            mode: 0o644,
            uid: 0,
            gid: 0,
            mtime: MTIME,
            xattrs: Vec::new(),
            kept: true,
        })
        .collect();
    build_tar(&entries)
}

fn freeze_bytes(store: &Path, tar: &[u8]) -> Result<ongrid_images::Frozen, FreezeError> {
    freeze_into(store, &mut &tar[..], &AtomicBool::new(false), &mut |_| {})
}

/// A tmpfs of `size` mounted on a fresh directory, unmounted on drop.
struct Tmpfs {
    dir: tempfile::TempDir,
}

impl Tmpfs {
    fn mount(size: &str) -> Tmpfs {
        let dir = tempfile::tempdir().expect("tempdir");
        let out = Command::new("mount")
            .args(["-t", "tmpfs", "-o", &format!("size={size}"), "tmpfs"])
            .arg(dir.path())
            .output()
            .expect("mount runs");
        assert!(
            out.status.success(),
            "these tests mount a small tmpfs as the image store and need root: {}",
            String::from_utf8_lossy(&out.stderr)
        );
        Tmpfs { dir }
    }
}

impl Drop for Tmpfs {
    fn drop(&mut self) {
        let _ = Command::new("umount").arg(self.dir.path()).status();
    }
}

#[test]
fn a_full_store_while_writing_squashfs_is_store_full_and_leaves_nothing() {
    let tmpfs = Tmpfs::mount("1m");
    let err = freeze_bytes(tmpfs.dir.path(), &noisy_tar(8, 512 * 1024)).expect_err("cannot fit");
    match &err {
        FreezeError::StoreFull { store } => assert_eq!(store, tmpfs.dir.path()),
        other => panic!("want StoreFull, got {other:?}"),
    }
    assert!(
        err.to_string()
            .contains("is full: free space or ask the admin"),
        "{err}"
    );
    assert_store_clean(tmpfs.dir.path());
}

#[test]
fn a_full_store_while_writing_the_sif_is_store_full_and_leaves_nothing() {
    // The squashfs (about 2 MiB) fits; the SIF copy of it does not.
    let tmpfs = Tmpfs::mount("3m");
    let err = freeze_bytes(tmpfs.dir.path(), &noisy_tar(4, 512 * 1024)).expect_err("cannot fit");
    assert!(
        matches!(err, FreezeError::StoreFull { .. }),
        "want StoreFull, got {err:?}"
    );
    assert_store_clean(tmpfs.dir.path());
}

#[test]
fn a_truncated_export_is_bad_tar_and_leaves_nothing() {
    let tar = build_tar(&entries());
    let store = tempfile::tempdir().expect("tempdir");
    // Cut inside a file's data.
    let err = freeze_bytes(store.path(), &tar[..tar.len() / 2]).expect_err("truncated");
    assert!(
        matches!(err, FreezeError::BadTar { .. }),
        "want BadTar, got {err:?}"
    );
    assert_store_clean(store.path());

    // Cut exactly between two entries: the tar parser alone would call that the end.
    let mut archive = tar::Archive::new(&tar[..]);
    let boundary = archive
        .entries()
        .expect("entries")
        .nth(10)
        .expect("11 entries")
        .expect("entry")
        .raw_header_position() as usize;
    let err = freeze_bytes(store.path(), &tar[..boundary]).expect_err("cut short");
    match &err {
        FreezeError::BadTar { reason } => assert!(reason.contains("cut short"), "{reason}"),
        other => panic!("want BadTar, got {other:?}"),
    }
    assert_store_clean(store.path());

    let err = freeze_bytes(store.path(), b"").expect_err("empty");
    assert!(
        matches!(err, FreezeError::BadTar { .. }),
        "want BadTar, got {err:?}"
    );
    assert_store_clean(store.path());
}

#[test]
fn a_corrupt_header_is_bad_tar() {
    let mut tar = build_tar(&entries());
    tar[512 + 10] ^= 0x55; // the name in the second header (`etc/`)
    let store = tempfile::tempdir().expect("tempdir");
    let err = freeze_bytes(store.path(), &tar).expect_err("corrupt");
    assert!(
        matches!(err, FreezeError::BadTar { .. }),
        "want BadTar, got {err:?}"
    );
    assert_store_clean(store.path());
}

/// Fails with an I/O error after `ok` bytes, like a Docker stream that breaks.
struct Breaks<'a> {
    data: &'a [u8],
    ok: usize,
}

impl Read for Breaks<'_> {
    fn read(&mut self, buf: &mut [u8]) -> io::Result<usize> {
        if self.ok == 0 {
            return Err(io::Error::new(
                io::ErrorKind::ConnectionReset,
                "docker went away",
            ));
        }
        let n = buf.len().min(self.ok).min(self.data.len());
        buf[..n].copy_from_slice(&self.data[..n]);
        self.data = &self.data[n..];
        self.ok -= n;
        Ok(n)
    }
}

#[test]
fn a_broken_export_stream_is_an_export_error() {
    let tar = noisy_tar(4, 300_000);
    let store = tempfile::tempdir().expect("tempdir");
    let mut reader = Breaks {
        data: &tar,
        ok: 500_000,
    };
    let err = freeze_into(
        store.path(),
        &mut reader,
        &AtomicBool::new(false),
        &mut |_| {},
    )
    .expect_err("broken");
    match &err {
        FreezeError::Export { source } => assert_eq!(source.kind(), io::ErrorKind::ConnectionReset),
        other => panic!("want Export, got {other:?}"),
    }
    assert_store_clean(store.path());
}

#[test]
fn a_layered_stream_is_refused() {
    // The whiteout comes after the file it deletes: only a multi-layer stream looks like this.
    let mut entries = vec![Entry {
        path: "etc/secret".into(),
        kind: Kind::File(b"s".to_vec()),
        mode: 0o600,
        uid: 0,
        gid: 0,
        mtime: MTIME,
        xattrs: Vec::new(),
        kept: false,
    }];
    let mut marker = entries[0].clone();
    marker.path = "etc/.wh.secret".into();
    entries.push(marker);
    let store = tempfile::tempdir().expect("tempdir");
    let err = freeze_bytes(store.path(), &build_tar(&entries)).expect_err("layered");
    match &err {
        FreezeError::BadTar { reason } => {
            assert!(reason.contains("not a merged docker export"), "{reason}")
        }
        other => panic!("want BadTar, got {other:?}"),
    }
    assert_store_clean(store.path());
}

/// Sets the cancel flag once `after` bytes were read.
struct CancelAfter<'a> {
    data: &'a [u8],
    read: usize,
    after: usize,
    cancel: &'a AtomicBool,
}

impl Read for CancelAfter<'_> {
    fn read(&mut self, buf: &mut [u8]) -> io::Result<usize> {
        let n = buf.len().min(self.data.len());
        buf[..n].copy_from_slice(&self.data[..n]);
        self.data = &self.data[n..];
        self.read += n;
        if self.read >= self.after {
            self.cancel.store(true, Ordering::Relaxed);
        }
        Ok(n)
    }
}

#[test]
fn cancel_stops_the_freeze_and_leaves_nothing() {
    let tar = noisy_tar(6, 1024 * 1024);
    let store = tempfile::tempdir().expect("tempdir");
    let cancel = AtomicBool::new(false);
    let mut reader = CancelAfter {
        data: &tar,
        read: 0,
        after: 2 * 1024 * 1024,
        cancel: &cancel,
    };
    let err = freeze_into(store.path(), &mut reader, &cancel, &mut |_| {}).expect_err("cancelled");
    assert!(
        matches!(err, FreezeError::Cancelled),
        "want Cancelled, got {err:?}"
    );
    assert!(
        reader.data.len() > 1024 * 1024,
        "stopped early, not at the end"
    );
    assert_store_clean(store.path());
}

#[test]
fn zstd_images_are_readable_too() {
    let tar = noisy_tar(2, 10_000);
    let store = tempfile::tempdir().expect("tempdir");
    let cancel = AtomicBool::new(false);
    let frozen = ongrid_images::freeze(ongrid_images::FreezeRequest {
        export: &mut &tar[..],
        config: config(),
        provenance: provenance(),
        compression: ongrid_images::Compression::Zstd,
        store: store.path(),
        estimated_size: tar.len() as u64,
        progress: &mut |_| {},
        cancel: &cancel,
    })
    .expect("freeze");
    let sif = ongrid_images::sif::SifImage::read_path(&frozen.sif_path).expect("valid");
    let offset = sif
        .primary_partition()
        .expect("partition")
        .offset
        .to_string();
    let path = frozen.sif_path.to_str().expect("utf-8");
    let stats = run("unsquashfs", &["-o", &offset, "-s", path]);
    assert!(stats.contains("Compression zstd"), "{stats}");
    let listing = run("unsquashfs", &["-o", &offset, "-l", path]);
    assert!(listing.contains("squashfs-root/data/blob-1"), "{listing}");
}
