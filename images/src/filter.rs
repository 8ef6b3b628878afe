//! The tar filter between `docker export` and `tar2sqfs`: reads the export entry by entry,
//! drops what the strip list names, re-emits everything else unchanged (path bytes, type,
//! mode including setuid/setgid/sticky, uid/gid, mtime, data, symlink targets, hard links,
//! device numbers, extended attributes), then appends Apptainer's metadata.
//!
//! **Whiteouts.** `docker export` of a container is the merged view of its layers, so it never
//! contains overlay whiteouts. The filter still handles them should a layered stream come in:
//! a marker `.wh.<name>` is never written and drops `<dir>/<name>` (and what lies under it) from
//! the rest of the stream; an opaque-directory marker `.wh..wh..opq` is never written and, as
//! within one layer, hides nothing that follows it. A stream cannot take back what it already
//! wrote, so a whiteout for a path that was already written, or an opaque marker for a
//! directory whose contents were already written (the layout of several layers concatenated),
//! is refused as not a merged export.
//!
//! **Hard links** whose target was dropped (stripped or whited out) are dropped too and listed
//! in the provenance (`dropped_hard_links`): the target's data was never kept, and none of the
//! strip list's locations is hard-linked from outside in a normal image.
//!
//! **Extended attributes** pass through in the `user.`, `trusted.` and `security.` namespaces,
//! the ones squashfs stores; others (such as POSIX ACLs in `system.`) are dropped and counted.

use std::cell::{Cell, RefCell};
use std::collections::HashSet;
use std::hash::{BuildHasher, RandomState};
use std::io::{self, BufReader, Read, Write};
use std::rc::Rc;
use std::sync::atomic::{AtomicBool, Ordering};

use tar::EntryType;

use crate::apptainer::{Generated, STANDARD_DIRS};
use crate::strip::{components, StripMatcher};
use crate::tarout::{AppendError, EntryMeta, TarWriter};

/// How often progress is reported (bytes of input between calls).
const PROGRESS_STEP: u64 = 4 * 1024 * 1024;
/// How many dropped hard links the provenance lists by name.
const MAX_LISTED: usize = 100;

#[derive(Debug, thiserror::Error)]
pub(crate) enum FilterError {
    #[error("cancelled")]
    Cancelled,
    #[error("{0}")]
    BadTar(String),
    #[error("reading the export: {0}")]
    Read(io::Error),
    #[error("writing to tar2sqfs: {0}")]
    Write(io::Error),
    #[error("writing the copy of the filtered tar: {0}")]
    Copy(io::Error),
}

/// The filter's output: the tar for `tar2sqfs`, and optionally a copy of the same entries
/// without the generated `/.singularity.d` tree (the frozen Docker image's filesystem).
pub(crate) struct Tee<'c, W> {
    pub main: W,
    pub copy: Option<&'c mut dyn Write>,
}

/// Marks a failed write to the copy, so it is told apart from a broken `tar2sqfs` pipe.
#[derive(Debug)]
struct CopyFailed(io::Error);

impl std::fmt::Display for CopyFailed {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        self.0.fmt(f)
    }
}

impl std::error::Error for CopyFailed {}

impl<W: Write> Tee<'_, W> {
    /// Ends the copy with tar's end-of-archive marker; later entries go to `main` only.
    fn finish_copy(&mut self) -> Result<(), FilterError> {
        if let Some(copy) = self.copy.take() {
            copy.write_all(&[0; 1024])
                .and_then(|()| copy.flush())
                .map_err(FilterError::Copy)?;
        }
        Ok(())
    }
}

impl<W: Write> Write for Tee<'_, W> {
    fn write(&mut self, buf: &[u8]) -> io::Result<usize> {
        let n = self.main.write(buf)?;
        if let Some(copy) = self.copy.as_mut() {
            copy.write_all(&buf[..n])
                .map_err(|e| io::Error::other(CopyFailed(e)))?;
        }
        Ok(n)
    }

    fn flush(&mut self) -> io::Result<()> {
        self.main.flush()?;
        if let Some(copy) = self.copy.as_mut() {
            copy.flush().map_err(|e| io::Error::other(CopyFailed(e)))?;
        }
        Ok(())
    }
}

/// A write error of the [`Tee`]: the copy's, or the pipe's.
fn write_error(e: io::Error) -> FilterError {
    if e.get_ref().is_some_and(|inner| inner.is::<CopyFailed>()) {
        match e.into_inner().map(|inner| inner.downcast::<CopyFailed>()) {
            Some(Ok(copy)) => return FilterError::Copy(copy.0),
            Some(Err(other)) => return FilterError::Write(io::Error::other(other)),
            None => unreachable!("checked above"),
        }
    }
    FilterError::Write(e)
}

/// What the filter did, for the provenance record.
#[derive(Debug, Clone, Default, PartialEq, Eq, serde::Serialize)]
pub(crate) struct FilterStats {
    pub entries_read: u64,
    pub entries_written: u64,
    pub bytes_read: u64,
    pub stripped_entries: u64,
    pub stripped_bytes: u64,
    /// Strip-list patterns that matched something.
    pub stripped_by: Vec<String>,
    pub whiteouts: u64,
    pub dropped_hard_links: Vec<String>,
    pub dropped_hard_links_total: u64,
    pub dropped_xattrs: u64,
    pub added_dirs: Vec<String>,
}

pub(crate) struct FilterInput<'a> {
    pub export: &'a mut dyn Read,
    pub generated: &'a [Generated],
    /// mtime of everything the filter adds.
    pub mtime: u64,
    pub cancel: &'a AtomicBool,
    pub progress: &'a mut dyn FnMut(u64),
}

/// Counts bytes the tar parser consumes and remembers whether the source itself failed (so a
/// broken export is told apart from a malformed tar).
struct Counting<R> {
    inner: R,
    count: Rc<Cell<u64>>,
    failure: Rc<RefCell<Option<io::Error>>>,
}

impl<R: Read> Read for Counting<R> {
    fn read(&mut self, buf: &mut [u8]) -> io::Result<usize> {
        match self.inner.read(buf) {
            Ok(n) => {
                self.count.set(self.count.get() + n as u64);
                Ok(n)
            }
            Err(e) => {
                if e.kind() != io::ErrorKind::Interrupted {
                    *self.failure.borrow_mut() = Some(io::Error::new(e.kind(), e.to_string()));
                }
                Err(e)
            }
        }
    }
}

/// Filters `input.export` into `out` and finishes the archive: the export's entries, checked to
/// be complete, then the standard directories and the generated tree, then the end marker.
pub(crate) fn filter_export<W: Write>(
    input: FilterInput<'_>,
    mut out: TarWriter<Tee<'_, W>>,
) -> Result<FilterStats, FilterError> {
    let FilterInput {
        export,
        generated,
        mtime,
        cancel,
        progress,
    } = input;
    let mut filter = Filter::new(cancel, progress);
    let mut archive = tar::Archive::new(filter.source(export));
    filter.copy_entries(&mut archive, &mut out)?;
    filter.check_complete()?;
    check_cancel(cancel)?;
    filter.append_generated(&mut out, generated, mtime)?;
    out.finish().map_err(write_error)?;
    drain(archive.into_inner())?;
    Ok(filter.finish())
}

/// The extended-attribute namespaces squashfs stores; others are dropped and counted.
const KEPT_XATTR_NAMESPACES: [&str; 3] = ["user.", "trusted.", "security."];

/// One run of the filter: what it has seen, dropped and counted so far.
struct Filter<'a> {
    cancel: &'a AtomicBool,
    progress: &'a mut dyn FnMut(u64),
    /// Bytes of the export the tar parser consumed.
    count: Rc<Cell<u64>>,
    /// The export's own read error, if it failed.
    failure: Rc<RefCell<Option<io::Error>>>,
    state: State,
    stats: FilterStats,
    reported: u64,
    end_of_last_entry: u64,
}

impl<'a> Filter<'a> {
    fn new(cancel: &'a AtomicBool, progress: &'a mut dyn FnMut(u64)) -> Self {
        Self {
            cancel,
            progress,
            count: Rc::new(Cell::new(0)),
            failure: Rc::new(RefCell::new(None)),
            state: State::default(),
            stats: FilterStats::default(),
            reported: 0,
            end_of_last_entry: 0,
        }
    }

    /// The export, buffered and counted.
    fn source<R: Read>(&self, export: R) -> Counting<BufReader<R>> {
        Counting {
            inner: BufReader::with_capacity(1024 * 1024, export),
            count: self.count.clone(),
            failure: self.failure.clone(),
        }
    }

    /// A parse error: the export's own read error if it failed, else a malformed tar.
    fn classify(&self, e: io::Error) -> FilterError {
        match self.failure.borrow_mut().take() {
            Some(read_error) => FilterError::Read(read_error),
            None => FilterError::BadTar(e.to_string()),
        }
    }

    fn copy_entries<R: Read, W: Write>(
        &mut self,
        archive: &mut tar::Archive<R>,
        out: &mut TarWriter<Tee<'_, W>>,
    ) -> Result<(), FilterError> {
        for entry in archive.entries().map_err(|e| self.classify(e))? {
            check_cancel(self.cancel)?;
            let mut entry = entry.map_err(|e| self.classify(e))?;
            if self.copy_entry(&mut entry, out)? {
                self.report_progress();
            }
        }
        Ok(())
    }

    /// Writes one entry of the export to `out` unless it is dropped; returns whether it was
    /// written.
    fn copy_entry<R: Read, W: Write>(
        &mut self,
        entry: &mut tar::Entry<'_, R>,
        out: &mut TarWriter<Tee<'_, W>>,
    ) -> Result<bool, FilterError> {
        self.stats.entries_read += 1;
        self.end_of_last_entry = entry.raw_file_position() + entry.size().div_ceil(512) * 512;
        let kind = entry.header().entry_type();
        if !is_kept_kind(kind, entry)? {
            return Ok(false);
        }
        let path = normalize(&entry.path_bytes())?;
        let parts: Vec<&[u8]> = components(&path).collect();
        if self.drops(entry, &path, &parts)? {
            return Ok(false);
        }
        let link = link_target(kind, entry, &path)?;
        if let (EntryType::Link, Some(target)) = (kind, &link) {
            if self.state.was_dropped(target) {
                self.drop_hard_link(&path, target);
                return Ok(false);
            }
        }
        let mut meta = entry_meta(entry, kind, &path, link)?;
        self.apply_pax(entry, &mut meta)?;
        let cancel = self.cancel;
        out.append(&meta, entry, &mut || check_cancel(cancel))
            .map_err(|e| self.append_error(e, &path))?;
        self.stats.entries_written += 1;
        self.state.wrote(&parts);
        Ok(true)
    }

    /// Whether the entry is dropped: a whiteout marker, whited out, or on the strip list.
    fn drops<R: Read>(
        &mut self,
        entry: &tar::Entry<'_, R>,
        path: &[u8],
        parts: &[&[u8]],
    ) -> Result<bool, FilterError> {
        if let Some(name) = parts.last().and_then(|n| n.strip_prefix(b".wh.")) {
            self.state.whiteout(&parts[..parts.len() - 1], name)?;
            self.stats.whiteouts += 1;
            return Ok(true);
        }
        if self.state.whited_out(path) {
            self.state.drop_path(path);
            return Ok(true);
        }
        let Some(rule) = StripMatcher::global().rule_for(parts) else {
            return Ok(false);
        };
        self.stats.stripped_entries += 1;
        self.stats.stripped_bytes += entry.size();
        if !self.stats.stripped_by.iter().any(|p| p == rule.pattern) {
            self.stats.stripped_by.push(rule.pattern.to_string());
        }
        self.state.drop_path(path);
        Ok(true)
    }

    /// Drops a hard link whose target was dropped, listing it in the provenance.
    fn drop_hard_link(&mut self, path: &[u8], target: &[u8]) {
        self.stats.dropped_hard_links_total += 1;
        if self.stats.dropped_hard_links.len() < MAX_LISTED {
            self.stats.dropped_hard_links.push(format!(
                "/{} -> /{}",
                String::from_utf8_lossy(path),
                String::from_utf8_lossy(target)
            ));
        }
        self.state.drop_path(path);
    }

    /// Takes the entry's PAX records: a whole-second mtime, and the extended attributes of the
    /// namespaces squashfs keeps.
    fn apply_pax<R: Read>(
        &mut self,
        entry: &mut tar::Entry<'_, R>,
        meta: &mut EntryMeta,
    ) -> Result<(), FilterError> {
        let Some(extensions) = entry.pax_extensions().map_err(|e| self.classify(e))? else {
            return Ok(());
        };
        for extension in extensions {
            let extension = extension.map_err(|e| self.classify(e))?;
            let Ok(key) = extension.key() else { continue };
            if key == "mtime" {
                if let Some(secs) = whole_seconds(extension.value_bytes()) {
                    meta.mtime = secs;
                }
                continue;
            }
            let Some(attribute) = key
                .strip_prefix("SCHILY.xattr.")
                .or_else(|| key.strip_prefix("LIBARCHIVE.xattr."))
            else {
                continue;
            };
            if KEPT_XATTR_NAMESPACES
                .iter()
                .any(|ns| attribute.starts_with(ns))
            {
                meta.xattrs.push((
                    format!("SCHILY.xattr.{attribute}"),
                    extension.value_bytes().to_vec(),
                ));
            } else {
                self.stats.dropped_xattrs += 1;
            }
        }
        Ok(())
    }

    fn append_error(&self, error: AppendError<FilterError>, path: &[u8]) -> FilterError {
        match error {
            AppendError::Write(e) => write_error(e),
            AppendError::Read(e) => self.classify(e),
            AppendError::ShortData { missing } => FilterError::BadTar(format!(
                "the data of /{} ends {missing} bytes early",
                String::from_utf8_lossy(path)
            )),
            AppendError::Stopped(e) => e,
        }
    }

    fn report_progress(&mut self) {
        if self.count.get() >= self.reported + PROGRESS_STEP {
            self.reported = self.count.get();
            (self.progress)(self.reported);
        }
    }

    /// The tar parser stops at EOF as quietly as at the end-of-archive marker; a stream cut
    /// short between two entries must not become a silently incomplete image.
    fn check_complete(&self) -> Result<(), FilterError> {
        if self.count.get() >= self.end_of_last_entry + 512 {
            return Ok(());
        }
        if let Some(read_error) = self.failure.borrow_mut().take() {
            return Err(FilterError::Read(read_error));
        }
        Err(FilterError::BadTar(
            "the stream ended without tar's end-of-archive marker: the export was cut short"
                .to_string(),
        ))
    }

    /// After the export's entries: the standard directories it lacks (also in the copy), the
    /// end of the copy, then the generated tree (in the main output only).
    fn append_generated<W: Write>(
        &mut self,
        out: &mut TarWriter<Tee<'_, W>>,
        generated: &[Generated],
        mtime: u64,
    ) -> Result<(), FilterError> {
        for (dir, mode) in STANDARD_DIRS {
            let parts: Vec<&[u8]> = components(dir.as_bytes()).collect();
            if !self.state.exists(&parts) {
                append_own(
                    out,
                    &root_meta(dir, EntryType::Directory, *mode, mtime),
                    &[],
                )?;
                self.stats.added_dirs.push(format!("/{dir}"));
            }
        }
        out.get_mut().finish_copy()?;
        for object in generated {
            let (meta, data) = generated_entry(object, mtime);
            append_own(out, &meta, data)?;
        }
        Ok(())
    }

    /// The stats, with the bytes read in all; reported as the last progress.
    fn finish(mut self) -> FilterStats {
        self.stats.bytes_read = self.count.get();
        (self.progress)(self.stats.bytes_read);
        self.stats
    }
}

fn check_cancel(cancel: &AtomicBool) -> Result<(), FilterError> {
    if cancel.load(Ordering::Relaxed) {
        Err(FilterError::Cancelled)
    } else {
        Ok(())
    }
}

/// Whether an entry of this type is written; [`EntryType::XGlobalHeader`] is skipped, and
/// types a container export never contains are refused.
fn is_kept_kind<R: Read>(kind: EntryType, entry: &tar::Entry<'_, R>) -> Result<bool, FilterError> {
    match kind {
        EntryType::Regular
        | EntryType::Continuous
        | EntryType::Link
        | EntryType::Symlink
        | EntryType::Char
        | EntryType::Block
        | EntryType::Directory
        | EntryType::Fifo => Ok(true),
        EntryType::XGlobalHeader => Ok(false),
        other => Err(FilterError::BadTar(format!(
            "entry {} has type {other:?}, which a container export never contains",
            String::from_utf8_lossy(&entry.path_bytes())
        ))),
    }
}

/// A hard link's target (normalized, as the paths it refers to) or a symlink's (byte for byte:
/// relative or absolute, dangling or not); `None` for other entries.
fn link_target<R: Read>(
    kind: EntryType,
    entry: &tar::Entry<'_, R>,
    path: &[u8],
) -> Result<Option<Vec<u8>>, FilterError> {
    match kind {
        EntryType::Link => {
            let target = entry
                .link_name_bytes()
                .ok_or_else(|| bad_entry(path, "hard link without a target"))?;
            Ok(Some(normalize(&target)?))
        }
        EntryType::Symlink => Ok(Some(
            entry
                .link_name_bytes()
                .ok_or_else(|| bad_entry(path, "symlink without a target"))?
                .into_owned(),
        )),
        _ => Ok(None),
    }
}

/// The entry as it is written: its header's fields, under the normalized `path`.
fn entry_meta<R: Read>(
    entry: &tar::Entry<'_, R>,
    kind: EntryType,
    path: &[u8],
    link: Option<Vec<u8>>,
) -> Result<EntryMeta, FilterError> {
    let header = entry.header();
    let number = |value: io::Result<u64>, what: &str| {
        value.map_err(|e| bad_entry(path, &format!("bad {what}: {e}")))
    };
    let regular = matches!(kind, EntryType::Regular | EntryType::Continuous);
    Ok(EntryMeta {
        path: if path.is_empty() {
            b"./".to_vec()
        } else {
            path.to_vec()
        },
        kind: if regular { EntryType::Regular } else { kind },
        mode: number(header.mode().map(u64::from), "mode")? as u32,
        uid: number(header.uid(), "uid")?,
        gid: number(header.gid(), "gid")?,
        mtime: number(header.mtime(), "mtime")?,
        size: if regular { entry.size() } else { 0 },
        link,
        device: device_numbers(header, kind, path)?,
        xattrs: Vec::new(),
    })
}

/// The major and minor numbers of a character or block device; `None` for other entries.
fn device_numbers(
    header: &tar::Header,
    kind: EntryType,
    path: &[u8],
) -> Result<Option<(u32, u32)>, FilterError> {
    if !matches!(kind, EntryType::Char | EntryType::Block) {
        return Ok(None);
    }
    let bad = |e: io::Error| bad_entry(path, &e.to_string());
    let major = header.device_major().map_err(bad)?.unwrap_or(0);
    let minor = header.device_minor().map_err(bad)?.unwrap_or(0);
    Ok(Some((major, minor)))
}

/// PAX mtime may have a fraction; squashfs keeps whole seconds.
fn whole_seconds(value: &[u8]) -> Option<u64> {
    let text = String::from_utf8_lossy(value);
    text.split('.').next().and_then(|s| s.parse().ok())
}

/// An entry the filter adds, owned by root.
fn root_meta(path: &str, kind: EntryType, mode: u32, mtime: u64) -> EntryMeta {
    EntryMeta {
        path: path.as_bytes().to_vec(),
        kind,
        mode,
        uid: 0,
        gid: 0,
        mtime,
        size: 0,
        link: None,
        device: None,
        xattrs: Vec::new(),
    }
}

/// One object of the generated `/.singularity.d` tree as an entry and its data.
fn generated_entry(object: &Generated, mtime: u64) -> (EntryMeta, &[u8]) {
    match object {
        Generated::Dir { path, mode } => (root_meta(path, EntryType::Directory, *mode, mtime), &[]),
        Generated::File { path, mode, data } => {
            let mut meta = root_meta(path, EntryType::Regular, *mode, mtime);
            meta.size = data.len() as u64;
            (meta, data)
        }
        Generated::Symlink { path, target } => {
            let mut meta = root_meta(path, EntryType::Symlink, 0o777, mtime);
            meta.link = Some(target.as_bytes().to_vec());
            (meta, &[])
        }
    }
}

/// Appends an entry the filter made itself (its data cannot fail to read).
fn append_own<W: Write>(
    out: &mut TarWriter<Tee<'_, W>>,
    meta: &EntryMeta,
    data: &[u8],
) -> Result<(), FilterError> {
    let mut never_stop = || Ok::<(), FilterError>(());
    out.append(meta, &mut &data[..], &mut never_stop)
        .map_err(|e| match e {
            AppendError::Write(e) => write_error(e),
            AppendError::Stopped(e) => e,
            AppendError::Read(e) => FilterError::Write(e),
            AppendError::ShortData { .. } => {
                FilterError::Write(io::Error::other("generated entry shorter than its size"))
            }
        })
}

/// Reads whatever follows the end marker so the producer (Docker) finishes cleanly.
fn drain(mut rest: impl Read) -> Result<(), FilterError> {
    let mut sink = [0u8; 64 * 1024];
    loop {
        match rest.read(&mut sink) {
            Ok(0) => return Ok(()),
            Ok(_) => {}
            Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
            Err(e) => return Err(FilterError::Read(e)),
        }
    }
}

fn bad_entry(path: &[u8], what: &str) -> FilterError {
    FilterError::BadTar(format!("/{}: {what}", String::from_utf8_lossy(path)))
}

/// The entry's path relative to the root: no leading `/` or `./`, no trailing `/`, no empty or
/// `.` components; `..` is refused. The root itself is the empty path.
pub(crate) fn normalize(path: &[u8]) -> Result<Vec<u8>, FilterError> {
    let mut out = Vec::with_capacity(path.len());
    for component in components(path) {
        match component {
            b"." => continue,
            b".." => {
                return Err(FilterError::BadTar(format!(
                    "entry path {} contains '..'",
                    String::from_utf8_lossy(path)
                )))
            }
            _ => {
                if !out.is_empty() {
                    out.push(b'/');
                }
                out.extend_from_slice(component);
            }
        }
    }
    Ok(out)
}

/// Paths seen so far, as 64-bit hashes (a few MB even for a million entries).
#[derive(Default)]
struct State {
    hasher: RandomState,
    /// Paths written.
    written: HashSet<u64>,
    /// Directories something was written under.
    non_empty: HashSet<u64>,
    /// Paths dropped (stripped, whited out): hard links to them are dropped too.
    dropped: HashSet<u64>,
    /// Whited-out paths still hiding what comes later.
    whiteouts: Vec<Vec<u8>>,
}

impl State {
    fn hash(&self, path: &[u8]) -> u64 {
        self.hasher.hash_one(path)
    }

    fn wrote(&mut self, parts: &[&[u8]]) {
        let path = parts.join(&b'/');
        self.written.insert(self.hash(&path));
        let mut ancestor = Vec::with_capacity(path.len());
        for part in parts.iter().take(parts.len().saturating_sub(1)) {
            if !ancestor.is_empty() {
                ancestor.push(b'/');
            }
            ancestor.extend_from_slice(part);
            self.non_empty.insert(self.hash(&ancestor));
        }
    }

    /// Whether the path was written, or something under it.
    fn exists(&self, parts: &[&[u8]]) -> bool {
        let path = parts.join(&b'/');
        let hash = self.hash(&path);
        self.written.contains(&hash) || self.non_empty.contains(&hash)
    }

    fn drop_path(&mut self, path: &[u8]) {
        self.dropped.insert(self.hash(path));
    }

    fn was_dropped(&self, path: &[u8]) -> bool {
        self.dropped.contains(&self.hash(path))
    }

    fn whited_out(&self, path: &[u8]) -> bool {
        self.whiteouts
            .iter()
            .any(|w| path.starts_with(w) && (path.len() == w.len() || path[w.len()] == b'/'))
    }

    fn whiteout(&mut self, dir: &[&[u8]], name: &[u8]) -> Result<(), FilterError> {
        let dir_path = dir.join(&b'/');
        if name == b".wh..opq" {
            // Opaque: hides the lower layers' contents of `dir`, which a merged stream has none
            // of. Contents already written means layers were concatenated.
            if self.non_empty.contains(&self.hash(&dir_path)) {
                return Err(FilterError::BadTar(format!(
                    "opaque-directory marker for /{} after its contents: a layered stream, \
                     not a merged docker export",
                    String::from_utf8_lossy(&dir_path)
                )));
            }
            return Ok(());
        }
        let mut target = dir_path;
        if !target.is_empty() {
            target.push(b'/');
        }
        target.extend_from_slice(name);
        let parts: Vec<&[u8]> = components(&target).collect();
        if self.exists(&parts) {
            return Err(FilterError::BadTar(format!(
                "whiteout for /{} after it was written: a layered stream, not a merged docker \
                 export",
                String::from_utf8_lossy(&target)
            )));
        }
        self.drop_path(&target);
        self.whiteouts.push(target);
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn normalize_strips_prefixes_and_refuses_parent_dirs() {
        assert_eq!(normalize(b"./etc/passwd").expect("ok"), b"etc/passwd");
        assert_eq!(normalize(b"/etc//ssh/").expect("ok"), b"etc/ssh");
        assert_eq!(normalize(b"./").expect("ok"), b"");
        assert!(normalize(b"a/../b").is_err());
    }

    fn paths(tar: &[u8]) -> Vec<String> {
        let mut archive = tar::Archive::new(tar);
        archive
            .entries()
            .expect("a tar")
            .map(|e| String::from_utf8_lossy(&e.expect("an entry").path_bytes()).into_owned())
            .collect()
    }

    #[test]
    fn the_copy_gets_the_same_entries_without_the_generated_tree() {
        let mut builder = tar::Builder::new(Vec::new());
        for (path, data) in [
            ("opt/data/hello.txt", &b"hello"[..]),
            ("tmp/x509up_u1000", b"proxy"),
            ("var/tmp/scratch", b"scratch"),
        ] {
            let mut header = tar::Header::new_gnu();
            header.set_size(data.len() as u64);
            header.set_mode(0o644);
            header.set_uid(0);
            header.set_gid(0);
            header.set_mtime(0);
            header.set_cksum();
            builder
                .append_data(&mut header, path, data)
                .expect("append");
        }
        let export = builder.into_inner().expect("tar");
        let generated = [
            Generated::Dir {
                path: ".singularity.d".into(),
                mode: 0o755,
            },
            Generated::File {
                path: ".singularity.d/runscript".into(),
                mode: 0o755,
                data: b"#!/bin/sh\n".to_vec(),
            },
        ];
        let (mut main, mut copy) = (Vec::new(), Vec::new());
        let cancel = AtomicBool::new(false);
        filter_export(
            FilterInput {
                export: &mut &export[..],
                generated: &generated,
                mtime: 0,
                cancel: &cancel,
                progress: &mut |_| {},
            },
            TarWriter::new(Tee {
                main: &mut main,
                copy: Some(&mut copy),
            }),
        )
        .expect("filtered");
        let (main, copy) = (paths(&main), paths(&copy));
        assert!(main.contains(&"opt/data/hello.txt".to_owned()), "{main:?}");
        assert!(!main
            .iter()
            .any(|p| p.contains("x509up") || p.contains("scratch")));
        let without_generated: Vec<String> = main
            .iter()
            .filter(|p| !p.starts_with(".singularity.d"))
            .cloned()
            .collect();
        assert_ne!(
            without_generated, main,
            "the SIF's stream has the generated tree"
        );
        assert_eq!(copy, without_generated);
    }
}
