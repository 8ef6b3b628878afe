//! A full freeze of the fixture filesystem, checked with siftool, unsquashfs and sqfs2tar.

use std::collections::BTreeSet;
use std::io::Read;
use std::os::unix::fs::{FileTypeExt, MetadataExt, PermissionsExt};
use std::path::Path;
use std::process::Command;
use std::sync::atomic::AtomicBool;

use ongrid_images::sif::{DataType, FsType, PartType, SifImage};
use ongrid_images::{strip_rule_for, ProvenanceRecord, PROVENANCE_OBJECT};
use sha2::{Digest, Sha256};

use crate::fixture::*;

/// What freezing adds: Apptainer's tree and links.
const GENERATED: &[&str] = &[
    ".singularity.d",
    ".singularity.d/env",
    ".singularity.d/actions",
    ".singularity.d/libs",
    ".singularity.d/env/01-base.sh",
    ".singularity.d/env/10-docker2singularity.sh",
    ".singularity.d/env/90-environment.sh",
    ".singularity.d/env/95-apps.sh",
    ".singularity.d/env/99-base.sh",
    ".singularity.d/env/99-runtimevars.sh",
    ".singularity.d/actions/exec",
    ".singularity.d/actions/run",
    ".singularity.d/actions/shell",
    ".singularity.d/actions/start",
    ".singularity.d/actions/test",
    ".singularity.d/runscript",
    ".singularity.d/startscript",
    ".singularity.d/labels.json",
    "singularity",
    ".run",
    ".exec",
    ".test",
    ".shell",
    "environment",
];

fn sha256_hex(data: &[u8]) -> String {
    hex::encode(Sha256::digest(data))
}

#[test]
fn freeze_produces_a_sif_that_outside_tools_accept_with_the_right_contents() {
    let entries = entries();
    let tar = build_tar(&entries);
    let store = tempfile::tempdir().expect("tempdir");
    let cancel = AtomicBool::new(false);
    let mut reported = Vec::new();
    let frozen = freeze_into(store.path(), &mut &tar[..], &cancel, &mut |n| {
        reported.push(n)
    })
    .expect("freeze");

    // The store: content address, read-only, nothing partial left.
    let sif_bytes = std::fs::read(&frozen.sif_path).expect("sif");
    let hex = sha256_hex(&sif_bytes);
    assert_eq!(frozen.digest, format!("sha256:{hex}"));
    assert_eq!(
        frozen.sif_path,
        store.path().join("sha256").join(format!("{hex}.sif"))
    );
    assert_eq!(frozen.size, sif_bytes.len() as u64);
    let mode = std::fs::metadata(&frozen.sif_path)
        .expect("meta")
        .permissions()
        .mode();
    assert_eq!(mode & 0o777, 0o444);
    assert!(files_under(&store.path().join(".partial")).is_empty());
    assert_eq!(
        reported.last(),
        Some(&(tar.len() as u64)),
        "progress ends at the tar size"
    );

    // siftool: header and descriptors.
    let sif = frozen.sif_path.to_str().expect("utf-8 path");
    let header = run("siftool", &["header", sif]);
    assert!(header.contains("Primary Architecture: amd64"), "{header}");
    assert!(header.contains("Descriptors Free:     45"), "{header}");
    let list = run("siftool", &["list", sif]);
    assert!(list.contains("Def.FILE"), "{list}");
    assert!(list.contains("JSON.Generic"), "{list}");
    assert!(list.contains("FS (Squashfs/*System/amd64)"), "{list}");
    let info = run("siftool", &["info", "3", sif]);
    assert!(info.contains("Partition Type:   *System"), "{info}");
    let offset: u64 = info
        .lines()
        .find_map(|l| l.trim().strip_prefix("Offset:"))
        .expect("offset line")
        .trim()
        .parse()
        .expect("offset number");
    assert_eq!(offset % 4096, 0);

    // Our reader agrees.
    let parsed = SifImage::read_path(&frozen.sif_path).expect("our reader");
    let primary = parsed.primary_partition().expect("primary partition");
    assert_eq!(primary.offset as u64, offset);
    let partition = primary.partition.expect("partition info");
    assert_eq!(
        (partition.fs_type, partition.part_type),
        (FsType::Squashfs, PartType::PrimarySystem)
    );
    assert!(parsed.find(DataType::Deffile, None).is_some());

    // The definition file and the JSON metadata carry the provenance.
    let part = store.path().join("part.sqfs");
    let dump = Command::new("siftool")
        .args(["dump", "3", sif])
        .output()
        .expect("siftool dump");
    assert!(dump.status.success());
    std::fs::write(&part, &dump.stdout).expect("write partition");
    assert_eq!(
        frozen.squashfs_digest,
        format!("sha256:{}", sha256_hex(&dump.stdout))
    );
    let deffile = run("siftool", &["dump", "1", sif]);
    for needle in [
        "/DC=org/DC=example/CN=Alice Example",
        "session: train1",
        "from: ongrid/dev:latest",
        "reference: mymodel:v1",
        "created: 2025-06-15T15:06:40+00:00",
        &format!("squashfs sha256: {}", sha256_hex(&dump.stdout)),
    ] {
        assert!(
            deffile.contains(needle),
            "deffile lacks {needle}:\n{deffile}"
        );
    }
    let json = run("siftool", &["dump", "2", sif]);
    let record: ProvenanceRecord = serde_json::from_str(&json).expect("provenance JSON");
    assert_eq!(record.provenance, provenance());
    assert_eq!(record.squashfs_digest, frozen.squashfs_digest);
    assert_eq!(record.config, config());
    assert_eq!(
        record.freeze["dropped_hard_links"],
        serde_json::json!(["/usr/local/bin/history-link -> /root/.bash_history"])
    );
    assert_eq!(
        parsed
            .find(DataType::GenericJson, Some(PROVENANCE_OBJECT))
            .map(|d| d.id),
        Some(2)
    );

    // unsquashfs reads the partition in place: listing with numeric owners.
    let offset_arg = offset.to_string();
    let listing = run("unsquashfs", &["-o", &offset_arg, "-lln", sif]);
    let line_of = |path: &str| {
        listing
            .lines()
            .find(|l| {
                l.ends_with(&format!("squashfs-root/{path}"))
                    || l.contains(&format!("squashfs-root/{path} -> "))
            })
            .unwrap_or_else(|| panic!("{path} not listed:\n{listing}"))
            .to_string()
    };
    assert!(line_of("usr/bin/sudoish").starts_with("-rwsr-xr-x 0/0 "));
    assert!(line_of("home/alice/project/train.py").starts_with("-rw-r--r-- 1000/1000 "));
    assert!(line_of("home/alice").starts_with("drwxr-x--- 1000/1000 "));
    assert!(line_of("srv/shared").starts_with("drwxrwsr-x 1000/2000 "));
    assert!(line_of("tmp").starts_with("drwxrwxrwt 0/0 "));
    assert!(line_of("usr/local/bin/tool-link").ends_with("tool-link -> tool"));
    assert!(line_of("singularity").ends_with("singularity -> .singularity.d/runscript"));
    assert!(line_of("dev/console").starts_with("crw--w---- 0/0 "));
    assert!(line_of("run/pipe").starts_with("prw-r--r-- 0/0 "));
    for e in entries
        .iter()
        .filter(|e| !e.kept && !GENERATED.contains(&e.path.as_str()))
    {
        assert!(
            !listing.contains(&format!("squashfs-root/{}\n", e.path)),
            "{} should be gone:\n{listing}",
            e.path
        );
    }

    // Extraction as root: every kept entry byte for byte, with owner, mode, mtime and links.
    let root = store.path().join("rootfs");
    run(
        "unsquashfs",
        &["-o", &offset_arg, "-d", root.to_str().expect("utf-8"), sif],
    );
    check_extracted_tree(&root, &entries);

    // The runscript runs the entrypoint with CMD as default arguments.
    let runscript = root.join(".singularity.d/runscript");
    assert_eq!(
        std::fs::metadata(&runscript).expect("runscript").mode() & 0o777,
        0o755
    );
    let text = std::fs::read_to_string(&runscript).expect("runscript text");
    assert!(text.contains("'/bin/echo' 'entry:'"), "{text}");
    assert!(text.contains("cd '/home/alice/project'"), "{text}");
    let output = |args: &[&str]| {
        let out = Command::new("/bin/sh")
            .arg(&runscript)
            .args(args)
            .output()
            .expect("sh");
        String::from_utf8_lossy(&out.stdout).into_owned()
    };
    assert_eq!(output(&[]), "entry: default-arg\n");
    assert_eq!(output(&["one", "two"]), "entry: one two\n");

    // The environment script exports the image's Env, caller values winning except PATH.
    let env_script = root.join(".singularity.d/env/10-docker2singularity.sh");
    let out = Command::new("/bin/sh")
        .arg("-c")
        .arg(format!(
            ". '{}'; printf '%s|%s|%s' \"$PATH\" \"$LANG\" \"$GREETING\"",
            env_script.display()
        ))
        .env("LANG", "de_DE.UTF-8")
        .env_remove("GREETING")
        .output()
        .expect("sh");
    assert_eq!(
        String::from_utf8_lossy(&out.stdout),
        "/opt/conda/bin:/usr/local/bin:/usr/bin:/bin|de_DE.UTF-8|hello \"world\" $HOME"
    );

    // Extended attributes survive (read back with squashfs-tools-ng's sqfs2tar).
    let back = Command::new("sqfs2tar")
        .arg(&part)
        .output()
        .expect("sqfs2tar must be installed");
    assert!(
        back.status.success(),
        "{}",
        String::from_utf8_lossy(&back.stderr)
    );
    let mut archive = tar::Archive::new(&back.stdout[..]);
    let mut found = None;
    for entry in archive.entries().expect("entries") {
        let mut entry = entry.expect("entry");
        if entry.path_bytes().ends_with(b"usr/bin/pinger") {
            let xattrs: Vec<(String, Vec<u8>)> = entry
                .pax_extensions()
                .expect("pax")
                .into_iter()
                .flatten()
                .filter_map(|x| x.ok())
                .filter_map(|x| Some((x.key().ok()?.to_string(), x.value_bytes().to_vec())))
                .filter(|(k, _)| k.contains("xattr"))
                .collect();
            found = Some(xattrs);
        }
    }
    assert_eq!(
        found,
        Some(vec![(
            "SCHILY.xattr.user.ongrid.test".to_string(),
            b"value\x00bytes".to_vec()
        )])
    );
}

fn check_extracted_tree(root: &Path, entries: &[Entry]) {
    let kept = kept(entries);
    let created = provenance().created_at.timestamp();
    let mut expected: BTreeSet<String> = kept.keys().cloned().collect();
    expected.extend(GENERATED.iter().map(|s| s.to_string()));
    // Standard directories the input lacks.
    for dir in ["proc", "sys"] {
        expected.insert(dir.to_string());
        let meta = std::fs::metadata(root.join(dir)).expect("standard dir");
        assert_eq!(meta.mode() & 0o7777, 0o555, "{dir}");
    }
    // Parents the tar only implies get tar2sqfs' defaults (root, 0755, the freeze time).
    for path in kept.keys() {
        let mut parent = Path::new(path).parent();
        while let Some(dir) = parent.filter(|p| !p.as_os_str().is_empty()) {
            let name = dir.to_str().expect("utf-8").to_string();
            if !kept.contains_key(&name) {
                let meta = std::fs::symlink_metadata(root.join(dir)).expect("implied dir");
                assert!(meta.is_dir());
                assert_eq!(
                    (meta.mode() & 0o7777, meta.uid(), meta.mtime()),
                    (0o755, 0, created),
                    "{name}"
                );
                expected.insert(name);
            }
            parent = dir.parent();
        }
    }
    let actual: BTreeSet<String> = files_under(root)
        .iter()
        .map(|p| {
            p.strip_prefix(root)
                .expect("under root")
                .to_str()
                .expect("utf-8")
                .to_string()
        })
        .collect();
    assert_eq!(
        actual, expected,
        "the image holds exactly the input minus the strip list, plus Apptainer's files"
    );
    for path in &actual {
        assert!(
            strip_rule_for(path.as_bytes()).is_none() || GENERATED.contains(&path.as_str()),
            "{path} is on the strip list"
        );
    }

    for (path, e) in &kept {
        let full = root.join(path);
        let meta = std::fs::symlink_metadata(&full).unwrap_or_else(|err| panic!("{path}: {err}"));
        assert_eq!(
            (meta.uid() as u64, meta.gid() as u64),
            (e.uid, e.gid),
            "owner of {path}"
        );
        assert_eq!(meta.mtime() as u64, e.mtime, "mtime of {path}");
        match &e.kind {
            Kind::Dir => assert!(meta.is_dir(), "{path}"),
            Kind::File(data) => {
                assert!(meta.is_file(), "{path}");
                let mut content = Vec::new();
                std::fs::File::open(&full)
                    .expect("open")
                    .read_to_end(&mut content)
                    .expect("read");
                assert!(content == *data, "content of {path} differs");
            }
            Kind::Symlink(target) => {
                assert!(meta.file_type().is_symlink(), "{path}");
                assert_eq!(
                    std::fs::read_link(&full).expect("link").to_str(),
                    Some(target.as_str())
                );
                continue; // symlink modes are always 0777
            }
            Kind::HardLink(target) => {
                let other = std::fs::symlink_metadata(root.join(target)).expect("target");
                assert_eq!(meta.ino(), other.ino(), "{path} is a hard link to {target}");
                assert_eq!(meta.nlink(), 2, "{path}");
                continue;
            }
            Kind::Fifo => assert!(meta.file_type().is_fifo(), "{path}"),
            Kind::CharDevice(major, minor) => {
                assert!(meta.file_type().is_char_device(), "{path}");
                let rdev = meta.rdev();
                let (got_major, got_minor) = (
                    ((rdev >> 8) & 0xfff) as u32,
                    ((rdev & 0xff) | ((rdev >> 12) & 0xfff00)) as u32,
                );
                assert_eq!((got_major, got_minor), (*major, *minor), "{path}");
            }
        }
        assert_eq!(meta.mode() & 0o7777, e.mode, "mode of {path}");
    }
}
