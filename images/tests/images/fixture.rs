//! The input filesystem of the tests, built as a tar stream the way `docker export` writes one,
//! and helpers to freeze it and run the outside tools.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::process::Command;
use std::sync::atomic::AtomicBool;

use chrono::TimeZone;
use ongrid_images::{
    freeze, Compression, FreezeError, FreezeRequest, Frozen, ImageConfig, Provenance,
};
use tar::{EntryType, Header};

/// What one input entry should look like in the image.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Kind {
    Dir,
    File(Vec<u8>),
    Symlink(String),
    /// Hard link to this path (relative to the root).
    HardLink(String),
    Fifo,
    CharDevice(u32, u32),
}

#[derive(Debug, Clone)]
pub struct Entry {
    pub path: String,
    pub kind: Kind,
    pub mode: u32,
    pub uid: u64,
    pub gid: u64,
    pub mtime: u64,
    pub xattrs: Vec<(String, Vec<u8>)>,
    /// Whether the image must contain it (false: stripped, whited out, a marker).
    pub kept: bool,
}

pub const MTIME: u64 = 1_700_000_000;

fn entry(path: &str, kind: Kind, mode: u32, owner: u64, kept: bool) -> Entry {
    Entry {
        path: path.to_string(),
        kind,
        mode,
        uid: owner,
        gid: owner,
        mtime: MTIME,
        xattrs: Vec::new(),
        kept,
    }
}

fn dir(path: &str, mode: u32, owner: u64) -> Entry {
    entry(path, Kind::Dir, mode, owner, true)
}

fn file(path: &str, data: &[u8], mode: u32, owner: u64) -> Entry {
    entry(path, Kind::File(data.to_vec()), mode, owner, true)
}

fn stripped(path: &str, data: &[u8]) -> Entry {
    entry(path, Kind::File(data.to_vec()), 0o600, 0, false)
}

/// Pseudo-random bytes (incompressible enough for the tests), deterministic per seed.
pub fn noise(len: usize, seed: u64) -> Vec<u8> {
    let mut state = seed
        .wrapping_mul(6364136223846793005)
        .wrapping_add(1442695040888963407);
    (0..len)
        .map(|_| {
            state ^= state << 13;
            state ^= state >> 7;
            state ^= state << 17;
            (state >> 24) as u8
        })
        .collect()
}

pub fn long_path() -> String {
    format!(
        "home/alice/project/{}weights.bin",
        "very-deep-directory/".repeat(8)
    )
}

pub fn long_pax_path() -> String {
    format!("opt/app/{}données-ü.txt", "pax-directory/".repeat(9))
}

/// The test filesystem: something of every kind, owners, modes, and a file in every place the
/// strip list names. Order is export order (parents first).
pub fn entries() -> Vec<Entry> {
    let mut setuid = file("usr/bin/sudoish", &noise(70_000, 1), 0o4755, 0);
    setuid.gid = 0;
    let mut capability = file("usr/bin/pinger", b"#!/bin/sh\necho ping\n", 0o755, 0);
    capability.xattrs = vec![(
        "SCHILY.xattr.user.ongrid.test".to_string(),
        b"value\x00bytes".to_vec(),
    )];
    let mut setgid_dir = dir("srv/shared", 0o2775, 1000);
    setgid_dir.gid = 2000;
    let mut entries = vec![
        dir("bin", 0o755, 0),
        dir("etc", 0o755, 0),
        file(
            "etc/passwd",
            b"root:x:0:0:root:/root:/bin/bash\nalice:x:1000:1000::/home/alice:/bin/bash\n",
            0o644,
            0,
        ),
        file("etc/shadow", b"root:*:19000:0:99999:7:::\n", 0o640, 0),
        dir("etc/ssh", 0o755, 0),
        file("etc/ssh/ssh_config", b"Host *\n", 0o644, 0),
        stripped("etc/ssh/ssh_host_ed25519_key", b"PRIVATE HOST KEY"),
        stripped("etc/ssh/ssh_host_ed25519_key.pub", b"ssh-ed25519 AAAA host"),
        dir("home", 0o755, 0),
        dir("home/alice", 0o750, 1000),
        // A whiteout before the path it hides (the path comes later and must not appear).
        entry(
            "home/alice/.wh.deleted.txt",
            Kind::File(Vec::new()),
            0o644,
            0,
            false,
        ),
        file("home/alice/.bashrc", b"export EDITOR=vim\n", 0o644, 1000),
        stripped("home/alice/.bash_history", b"export TOKEN=secret\n"),
        stripped("home/alice/.python_history", b"import os\n"),
        stripped("home/alice/.zsh_history", b": 1:0;ls\n"),
        entry("home/alice/.ssh", Kind::Dir, 0o700, 1000, false),
        stripped("home/alice/.ssh/id_ed25519", b"PRIVATE USER KEY"),
        entry("home/alice/.cache", Kind::Dir, 0o755, 1000, true),
        entry("home/alice/.cache/pip", Kind::Dir, 0o755, 1000, false),
        stripped("home/alice/.cache/pip/http-v2/a/b/c.body", &noise(5000, 2)),
        file(
            "home/alice/.cache/keep.txt",
            b"not a download cache\n",
            0o644,
            1000,
        ),
        entry("home/alice/.npm", Kind::Dir, 0o755, 1000, true),
        stripped("home/alice/.npm/_cacache/index-v5/00/ab", b"npm"),
        dir("home/alice/project", 0o755, 1000),
        file(
            "home/alice/project/train.py",
            b"print('training')\n",
            0o644,
            1000,
        ),
        file(
            "home/alice/données-ü.txt",
            "non-ASCII name: ü é ß\n".as_bytes(),
            0o644,
            1000,
        ),
        entry(
            "home/alice/deleted.txt",
            Kind::File(b"hidden by the whiteout".to_vec()),
            0o644,
            1000,
            false,
        ),
        dir("opt", 0o755, 0),
        dir("opt/app", 0o755, 0),
        // An opaque marker before the directory's contents (one layer): hides nothing here.
        entry(
            "opt/app/.wh..wh..opq",
            Kind::File(Vec::new()),
            0o644,
            0,
            false,
        ),
        file("opt/app/new.txt", b"after the opaque marker\n", 0o644, 0),
        dir("opt/conda", 0o755, 0),
        dir("opt/conda/pkgs", 0o755, 0),
        stripped("opt/conda/pkgs/numpy-1.26.4-py311.conda", &noise(3000, 3)),
        stripped("opt/conda/pkgs/zlib-1.2.13-0.tar.bz2", &noise(3000, 4)),
        file(
            "opt/conda/pkgs/numpy-1.26.4-py311/lib/numpy.so",
            &noise(9000, 5),
            0o755,
            0,
        ),
        stripped(
            "opt/spack/var/spack/cache/_source-cache/archive/zlib.tar.gz",
            &noise(2000, 6),
        ),
        file("opt/spack/bin/spack", b"#!/bin/sh\n", 0o755, 0),
        dir("root", 0o700, 0),
        stripped("root/.bash_history", b"rm -rf /\n"),
        stripped("root/.python_history", b"1+1\n"),
        entry(
            "root/.cache/pip/wheels/x.whl",
            Kind::File(b"wheel".to_vec()),
            0o644,
            0,
            false,
        ),
        dir("run", 0o755, 0),
        entry("run/ongrid", Kind::Dir, 0o755, 0, false),
        stripped("run/ongrid/sftp/sftp-server", &noise(4000, 7)),
        entry("run/pipe", Kind::Fifo, 0o644, 0, true),
        setgid_dir,
        dir("tmp", 0o1777, 0),
        stripped("tmp/x509up_u1000", b"PROXY"),
        entry("tmp/build", Kind::Dir, 0o755, 1000, false),
        stripped("tmp/build/obj.o", &noise(3000, 8)),
        dir("usr", 0o755, 0),
        dir("usr/bin", 0o755, 0),
        setuid,
        capability,
        dir("usr/local", 0o755, 0),
        dir("usr/local/bin", 0o755, 0),
        file("usr/local/bin/tool", &noise(200_000, 9), 0o755, 0),
        entry(
            "usr/local/bin/tool-link",
            Kind::Symlink("tool".into()),
            0o777,
            0,
            true,
        ),
        entry(
            "usr/bin/tool-abs",
            Kind::Symlink("/usr/local/bin/tool".into()),
            0o777,
            0,
            true,
        ),
        entry(
            "usr/bin/dangling",
            Kind::Symlink("../nowhere/at all".into()),
            0o777,
            0,
            true,
        ),
        entry(
            "usr/local/bin/tool-hard",
            Kind::HardLink("usr/local/bin/tool".into()),
            0o755,
            0,
            true,
        ),
        // A hard link to a stripped file is dropped with it.
        entry(
            "usr/local/bin/history-link",
            Kind::HardLink("root/.bash_history".into()),
            0o600,
            0,
            false,
        ),
        dir("var", 0o755, 0),
        dir("var/cache", 0o755, 0),
        dir("var/cache/apt", 0o755, 0),
        dir("var/cache/apt/archives", 0o755, 0),
        stripped("var/cache/apt/archives/curl_7.88.deb", &noise(1000, 10)),
        file("var/cache/apt/pkgcache.bin", b"apt index", 0o644, 0),
        dir("var/tmp", 0o1777, 0),
        stripped("var/tmp/session.log", b"log"),
        entry("dev", Kind::Dir, 0o755, 0, true),
        entry("dev/console", Kind::CharDevice(5, 1), 0o620, 0, true),
        stripped(".dockerenv", b""),
        entry(".singularity.d", Kind::Dir, 0o755, 0, false),
        stripped(
            ".singularity.d/runscript",
            b"#!/bin/sh\necho old runscript\n",
        ),
        entry(
            "singularity",
            Kind::Symlink("/somewhere/else".into()),
            0o777,
            0,
            false,
        ),
    ];
    entries.push(file(&long_path(), &noise(1000, 11), 0o644, 1000));
    entries.push(file(&long_pax_path(), b"long PAX path", 0o644, 0));
    entries
}

/// Writes `entries` as a tar stream: ustar, GNU long names for `long_path`, PAX for
/// `long_pax_path` and for extended attributes (Docker's Go writer uses PAX).
pub fn build_tar(entries: &[Entry]) -> Vec<u8> {
    let mut builder = tar::Builder::new(Vec::new());
    for e in entries {
        let mut header = Header::new_gnu();
        header.set_mode(e.mode);
        header.set_uid(e.uid);
        header.set_gid(e.gid);
        header.set_mtime(e.mtime);
        header.set_size(0);
        let pax_path = e.path == long_pax_path();
        let mut pax: Vec<(&str, &[u8])> = e
            .xattrs
            .iter()
            .map(|(k, v)| (k.as_str(), v.as_slice()))
            .collect();
        if pax_path {
            pax.push(("path", e.path.as_bytes()));
        }
        if !pax.is_empty() {
            builder.append_pax_extensions(pax).expect("pax");
        }
        let name = if pax_path {
            "opt/app/truncated".to_string()
        } else {
            e.path.clone()
        };
        match &e.kind {
            Kind::Dir => {
                header.set_entry_type(EntryType::Directory);
                builder
                    .append_data(&mut header, format!("{name}/"), std::io::empty())
                    .expect("dir");
            }
            Kind::File(data) => {
                header.set_entry_type(EntryType::Regular);
                header.set_size(data.len() as u64);
                builder
                    .append_data(&mut header, &name, &data[..])
                    .expect("file");
            }
            Kind::Symlink(target) => {
                header.set_entry_type(EntryType::Symlink);
                builder
                    .append_link(&mut header, &name, target)
                    .expect("symlink");
            }
            Kind::HardLink(target) => {
                header.set_entry_type(EntryType::Link);
                builder
                    .append_link(&mut header, &name, target)
                    .expect("link");
            }
            Kind::Fifo => {
                header.set_entry_type(EntryType::Fifo);
                builder
                    .append_data(&mut header, &name, std::io::empty())
                    .expect("fifo");
            }
            Kind::CharDevice(major, minor) => {
                header.set_entry_type(EntryType::Char);
                header.set_device_major(*major).expect("major");
                header.set_device_minor(*minor).expect("minor");
                builder
                    .append_data(&mut header, &name, std::io::empty())
                    .expect("device");
            }
        }
    }
    builder.into_inner().expect("tar")
}

pub fn config() -> ImageConfig {
    ImageConfig {
        env: vec![
            "PATH=/opt/conda/bin:/usr/local/bin:/usr/bin:/bin".to_string(),
            "LANG=C.UTF-8".to_string(),
            "GREETING=hello \"world\" $HOME".to_string(),
        ],
        working_dir: Some("/home/alice/project".to_string()),
        entrypoint: vec!["/bin/echo".to_string(), "entry:".to_string()],
        cmd: vec!["default-arg".to_string()],
        user: Some("1000:1000".to_string()),
    }
}

pub fn provenance() -> Provenance {
    Provenance {
        owner: "/DC=org/DC=example/CN=Alice Example".to_string(),
        session: "train1".to_string(),
        base_image: "ongrid/dev:latest".to_string(),
        reference: "mymodel:v1".to_string(),
        created_at: chrono::Utc
            .timestamp_opt(1_750_000_000, 0)
            .single()
            .expect("time"),
    }
}

/// Freezes `tar` into `store`.
pub fn freeze_into(
    store: &Path,
    tar: &mut dyn std::io::Read,
    cancel: &AtomicBool,
    progress: &mut dyn FnMut(u64),
) -> Result<Frozen, FreezeError> {
    freeze(FreezeRequest {
        export: tar,
        config: config(),
        provenance: provenance(),
        compression: Compression::Gzip,
        store,
        estimated_size: 0,
        progress,
        cancel,
    })
}

/// Runs a tool; panics with its output when it fails (or is missing).
pub fn run(program: &str, args: &[&str]) -> String {
    let out = Command::new(program)
        .args(args)
        .output()
        .unwrap_or_else(|e| panic!("{program} must be installed (see .ci/run): {e}"));
    assert!(
        out.status.success(),
        "{program} {args:?} failed: {}\n{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    String::from_utf8_lossy(&out.stdout).into_owned()
}

/// Every file name under `dir`, recursively, relative to it.
pub fn files_under(dir: &Path) -> Vec<PathBuf> {
    let mut out = Vec::new();
    if let Ok(read) = std::fs::read_dir(dir) {
        for entry in read.flatten() {
            out.push(entry.path());
            if entry.file_type().is_ok_and(|t| t.is_dir()) {
                out.extend(files_under(&entry.path()));
            }
        }
    }
    out
}

/// The store must hold no partial work and no image.
pub fn assert_store_clean(store: &Path) {
    let left = files_under(store)
        .into_iter()
        .filter(|p| p.is_file())
        .collect::<Vec<_>>();
    assert!(left.is_empty(), "files left in the store: {left:?}");
}

/// Expected kept entries by path.
pub fn kept(entries: &[Entry]) -> BTreeMap<String, Entry> {
    entries
        .iter()
        .filter(|e| e.kept)
        .map(|e| (e.path.clone(), e.clone()))
        .collect()
}
