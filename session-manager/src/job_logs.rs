//! Jobs' output, kept by the manager after the containers are gone: one file per job,
//! `<job_log_dir>/<job id>.log`, stdout and stderr in the order the agent sent them, at most
//! [`JOB_LOG_CAP`] bytes. Past the cap, one line says the rest was dropped.
//!
//! The store keeps how many bytes of the job's output stream the manager has consumed (the
//! offset the agent continues from); this file keeps the bytes. A chunk that starts before that
//! offset (a report repeated after a restart, or made from an older desired state) adds only
//! what follows it; one that starts after it, or ends before it, is ignored: the agent sends it
//! again from the offset in its next desired state. The stored offset is what counts: below the
//! cap, bytes the file holds past it (appended by a sync whose record of them was not stored)
//! are cut before the chunk is added, so a chunk sent again is not kept twice. (A node's syncs
//! come one at a time; two appends of one job at once, an agent's retry while its first sync
//! still runs, may still interleave.)

use std::io::{self, Write};
use std::path::{Path, PathBuf};

use ongrid_core::job::{JobId, LogChunk, JOB_LOG_CAP};
use tokio::io::{AsyncReadExt, AsyncSeekExt};

/// The line that ends a log whose output went past the cap.
pub const TRUNCATED: &str = "\n[ongrid: output past the 16 MiB cap was dropped]\n";

/// The directory of jobs' output files.
#[derive(Debug, Clone)]
pub struct JobLogs {
    dir: PathBuf,
}

impl JobLogs {
    pub fn new(dir: PathBuf) -> Self {
        Self { dir }
    }

    fn path(&self, id: JobId) -> PathBuf {
        self.dir.join(format!("{id}.log"))
    }

    /// Appends what `chunk` has past `consumed` (what the manager has of the stream, as stored)
    /// to the job's file when it reaches `consumed`, after cutting what the file holds past
    /// `consumed` when that is below the cap; returns the new stream offset, or `None` when the
    /// chunk was ignored (it starts past `consumed`, or ends before it).
    pub async fn append(
        &self,
        id: JobId,
        consumed: u64,
        chunk: &LogChunk,
    ) -> io::Result<Option<u64>> {
        let end = chunk.offset.saturating_add(chunk.data.len() as u64);
        if chunk.offset > consumed || end < consumed {
            return Ok(None);
        }
        let skip = usize::try_from(consumed - chunk.offset).unwrap_or(usize::MAX);
        let data = chunk.data.get(skip..).unwrap_or_default().to_vec();
        let (dir, path) = (self.dir.clone(), self.path(id));
        // One trip to the blocking pool for the whole append (each `tokio::fs` call is one).
        // It runs to its end even when the sync that asked for it is dropped meanwhile.
        match tokio::task::spawn_blocking(move || append_at(&dir, &path, consumed, &data)).await {
            Ok(appended) => appended?,
            Err(failed) if failed.is_panic() => std::panic::resume_unwind(failed.into_panic()),
            Err(failed) => return Err(io::Error::other(failed)),
        }
        Ok(Some(end))
    }

    /// Deletes the job's output file (its record was removed); `false` when there was none.
    pub async fn remove(&self, id: JobId) -> io::Result<bool> {
        match tokio::fs::remove_file(self.path(id)).await {
            Ok(()) => Ok(true),
            Err(e) if e.kind() == io::ErrorKind::NotFound => Ok(false),
            Err(e) => Err(e),
        }
    }

    /// Where the job's output file is (for messages).
    pub fn file(&self, id: JobId) -> PathBuf {
        self.path(id)
    }

    /// At most `max` bytes of the job's kept output from `offset`, and the kept size.
    pub async fn read(&self, id: JobId, offset: u64, max: usize) -> io::Result<(Vec<u8>, u64)> {
        read_at(&self.path(id), offset, max).await
    }
}

/// [`JobLogs::append`]'s file work: `data` added to the file at `path` (created, and its
/// directory `dir` when missing), which holds `consumed` bytes of the stream, cut back to them
/// first when it holds more below the cap.
fn append_at(dir: &Path, path: &Path, consumed: u64, data: &[u8]) -> io::Result<()> {
    let open = || {
        std::fs::OpenOptions::new()
            .create(true)
            .append(true)
            .open(path)
    };
    let mut file = match open() {
        Err(e) if e.kind() == io::ErrorKind::NotFound => {
            std::fs::create_dir_all(dir)?;
            open()?
        }
        opened => opened?,
    };
    let mut kept = file.metadata()?.len();
    let room = JOB_LOG_CAP.saturating_sub(TRUNCATED.len() as u64);
    // Below the cap the file holds the stream's first `consumed` bytes; more were appended
    // by a sync whose record of them failed, and the agent sends them again from
    // `consumed`.
    if kept > consumed && consumed <= room {
        file.set_len(consumed)?;
        kept = consumed;
    }
    if kept + data.len() as u64 <= room {
        file.write_all(data)?;
    } else if kept <= room {
        let fits = usize::try_from(room - kept)
            .unwrap_or(usize::MAX)
            .min(data.len());
        file.write_all(&data[..fits])?;
        file.write_all(TRUNCATED.as_bytes())?;
    }
    Ok(())
}

/// At most `max` bytes of the file at `path` from `offset`, and its size; a missing file is
/// empty (the job has not written yet). Fewer when the file was cut meanwhile
/// ([`JobLogs::append`]): what it holds then is read.
pub async fn read_at(path: &Path, offset: u64, max: usize) -> io::Result<(Vec<u8>, u64)> {
    let mut file = match tokio::fs::File::open(path).await {
        Ok(file) => file,
        Err(e) if e.kind() == io::ErrorKind::NotFound => return Ok((Vec::new(), 0)),
        Err(e) => return Err(e),
    };
    let size = file.metadata().await?.len();
    if offset >= size {
        return Ok((Vec::new(), size));
    }
    file.seek(io::SeekFrom::Start(offset)).await?;
    let want = usize::try_from(size - offset)
        .unwrap_or(usize::MAX)
        .min(max);
    let mut data = Vec::with_capacity(want);
    file.take(u64::try_from(want).unwrap_or(u64::MAX))
        .read_to_end(&mut data)
        .await?;
    Ok((data, size))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn chunk(offset: u64, data: &[u8]) -> LogChunk {
        LogChunk {
            offset,
            data: data.to_vec(),
            complete: false,
        }
    }

    #[tokio::test]
    async fn chunks_append_in_order_and_repeats_are_ignored() {
        let dir = tempfile::tempdir().unwrap();
        let logs = JobLogs::new(dir.path().join("jobs"));
        let id = JobId::new_random();
        assert_eq!(logs.read(id, 0, 100).await.unwrap(), (vec![], 0));
        assert_eq!(
            logs.append(id, 0, &chunk(0, b"hello ")).await.unwrap(),
            Some(6)
        );
        assert_eq!(
            logs.append(id, 6, &chunk(0, b"hello ")).await.unwrap(),
            Some(6),
            "a repeat adds nothing"
        );
        assert_eq!(
            logs.append(id, 6, &chunk(0, b"hell")).await.unwrap(),
            None,
            "a chunk ending before what is kept is ignored"
        );
        assert_eq!(
            logs.append(id, 6, &chunk(7, b"orld\n")).await.unwrap(),
            None,
            "a gap is never filled with what follows it"
        );
        assert_eq!(
            logs.append(id, 6, &chunk(6, b"world\n")).await.unwrap(),
            Some(12)
        );
        assert_eq!(
            logs.read(id, 0, 100).await.unwrap(),
            (b"hello world\n".to_vec(), 12)
        );
        assert_eq!(logs.read(id, 6, 3).await.unwrap(), (b"wor".to_vec(), 12));
        assert_eq!(logs.read(id, 12, 3).await.unwrap(), (vec![], 12));
        // From an older offset (a stale desired state): only the new part is added.
        assert_eq!(
            logs.append(id, 12, &chunk(6, b"world\nagain\n"))
                .await
                .unwrap(),
            Some(18)
        );
        assert_eq!(
            logs.read(id, 0, 100).await.unwrap(),
            (b"hello world\nagain\n".to_vec(), 18)
        );
        assert!(logs.remove(id).await.unwrap());
        assert!(!logs.file(id).exists());
        assert_eq!(logs.read(id, 0, 100).await.unwrap(), (vec![], 0));
        assert!(!logs.remove(id).await.unwrap());
    }

    #[tokio::test]
    async fn output_appended_but_not_recorded_is_replaced_when_sent_again() {
        let dir = tempfile::tempdir().unwrap();
        let logs = JobLogs::new(dir.path().to_owned());
        let id = JobId::new_random();
        assert_eq!(
            logs.append(id, 0, &chunk(0, b"hello ")).await.unwrap(),
            Some(6)
        );
        // Appended, but the record of offset 12 was lost: still 6 as stored.
        assert_eq!(
            logs.append(id, 6, &chunk(6, b"world\n")).await.unwrap(),
            Some(12)
        );
        assert_eq!(
            logs.append(id, 6, &chunk(6, b"world\nagain\n"))
                .await
                .unwrap(),
            Some(18)
        );
        assert_eq!(
            logs.read(id, 0, 100).await.unwrap(),
            (b"hello world\nagain\n".to_vec(), 18)
        );
    }

    #[tokio::test]
    async fn output_across_the_cap_appended_but_not_recorded_is_cut_and_capped_again() {
        let dir = tempfile::tempdir().unwrap();
        let logs = JobLogs::new(dir.path().to_owned());
        let id = JobId::new_random();
        let room = JOB_LOG_CAP - TRUNCATED.len() as u64;
        let below = vec![b'x'; usize::try_from(room - 4).unwrap()];
        let consumed = logs
            .append(id, 0, &chunk(0, &below))
            .await
            .unwrap()
            .unwrap();
        // Across the cap; its record was lost.
        let crossed = chunk(consumed, b"12345678");
        logs.append(id, consumed, &crossed).await.unwrap();
        let again = chunk(consumed, b"123456789");
        assert_eq!(
            logs.append(id, consumed, &again).await.unwrap(),
            Some(consumed + 9)
        );
        let (tail, size) = logs.read(id, room - 8, 1000).await.unwrap();
        assert_eq!(size, JOB_LOG_CAP);
        assert_eq!(tail, [b"xxxx1234", TRUNCATED.as_bytes()].concat());
    }

    #[tokio::test]
    async fn output_past_the_cap_is_dropped_with_one_line_saying_so() {
        let dir = tempfile::tempdir().unwrap();
        let logs = JobLogs::new(dir.path().to_owned());
        let id = JobId::new_random();
        let big = vec![b'x'; 1024 * 1024];
        let mut consumed = 0;
        for _ in 0..17 {
            consumed = logs
                .append(id, consumed, &chunk(consumed, &big))
                .await
                .unwrap()
                .unwrap();
        }
        assert_eq!(consumed, 17 * 1024 * 1024);
        let (tail, size) = logs
            .read(id, JOB_LOG_CAP - TRUNCATED.len() as u64 - 1, 1000)
            .await
            .unwrap();
        assert_eq!(size, JOB_LOG_CAP);
        assert_eq!(&tail[1..], TRUNCATED.as_bytes());
    }
}
