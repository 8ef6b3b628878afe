//! A job's output, kept in a file on the node so it survives the container.
//!
//! A [`Follower`] task copies the container's stdout and stderr (`docker logs --follow`, in the
//! order they came) into `<job id>.log`: the first [`JOB_LOG_CAP`] bytes, then one line saying
//! the rest was dropped. The task ends when the container stops and Docker has sent everything
//! ([`Follower::done`]). A follower started again (the agent restarted while the container
//! exists) rewrites the file from the container's first byte: Docker keeps a container's output
//! until the container is removed, and gives it in the same order each time. [`chunk`] reads
//! what follows the manager's offset, at most [`JOB_LOG_CHUNK_MAX`] bytes.
//!
//! Every piece written (flushed, so a reader of the file sees it) and the end bump the
//! [`OutputSignal`] the follower was given: the sync loop reports new output soon after it
//! comes instead of on its periodic sync.

use std::io::{Read, Seek, SeekFrom};
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Duration;

use futures::StreamExt;
use ongrid_core::job::{LogChunk, JOB_LOG_CAP, JOB_LOG_CHUNK_MAX};
use tokio::io::AsyncWriteExt;
use tokio::sync::watch;
use tracing::warn;

use crate::runtime::{error_chain, ContainerRuntime};

/// The line that replaces output past the cap.
pub fn truncation_line() -> String {
    format!(
        "\n[ongrid: output truncated: only the first {} MiB of a job's output is kept]\n",
        JOB_LOG_CAP / (1024 * 1024)
    )
}

/// Counts the pieces of output the followers wrote (and their ends); the sync loop watches it
/// (`Jobs::output_written`) to report new output soon.
pub type OutputSignal = Arc<watch::Sender<u64>>;

/// Says that output was written (or a follower ended): something new to report.
pub fn bump(signal: &OutputSignal) {
    signal.send_modify(|count| *count = count.wrapping_add(1));
}

/// The task that copies one container's output into its log file.
#[derive(Debug)]
pub struct Follower {
    done: watch::Receiver<bool>,
    task: tokio::task::JoinHandle<()>,
}

impl Follower {
    /// Starts copying the output of container `container_id` into `path` (from its start),
    /// bumping `signal` at every piece and at the end.
    pub fn spawn(
        runtime: &dyn ContainerRuntime,
        container_id: &str,
        path: PathBuf,
        signal: OutputSignal,
    ) -> Self {
        let (finished, done) = watch::channel(false);
        let output = runtime.follow_logs(container_id);
        let container = container_id.to_owned();
        let task = tokio::spawn(async move {
            match copy_capped(output, &path, &signal).await {
                Ok(()) => {
                    finished.send_replace(true);
                    bump(&signal);
                }
                Err(error) => {
                    warn!(%container, log = %path.display(), %error, "Copying a job's output failed; trying again on the next sync.");
                }
            }
        });
        Self { done, task }
    }

    /// All the output is in the file: the container stopped and Docker sent everything.
    pub fn done(&self) -> bool {
        *self.done.borrow()
    }

    /// Waits until [`Follower::done`], at most `limit`; whether it is.
    pub async fn wait_done(&self, limit: Duration) -> bool {
        let mut done = self.done.clone();
        // An error: the task ended without finishing (its sender is gone).
        let finished = async { done.wait_for(|done| *done).await.is_ok() };
        tokio::time::timeout(limit, finished).await.unwrap_or(false)
    }

    /// The task ended, done or not.
    pub fn ended(&self) -> bool {
        self.task.is_finished()
    }

    /// The task ended without finishing (an error): start another.
    pub fn failed(&self) -> bool {
        self.task.is_finished() && !self.done()
    }
}

impl Drop for Follower {
    fn drop(&mut self) {
        self.task.abort();
    }
}

async fn copy_capped(
    mut output: futures::stream::BoxStream<'static, Result<Vec<u8>, crate::runtime::RuntimeError>>,
    path: &Path,
    signal: &OutputSignal,
) -> Result<(), String> {
    let mut file = tokio::fs::File::create(path)
        .await
        .map_err(|e| format!("creating {}: {e}", path.display()))?;
    let mut kept = 0u64;
    let mut truncated = false;
    while let Some(chunk) = output.next().await {
        let chunk = chunk.map_err(|e| error_chain(&e))?;
        if truncated {
            continue;
        }
        let room = usize::try_from(JOB_LOG_CAP - kept).unwrap_or(usize::MAX);
        let take = chunk.len().min(room);
        file.write_all(&chunk[..take])
            .await
            .map_err(|e| format!("writing {}: {e}", path.display()))?;
        kept += take as u64;
        if take < chunk.len() {
            truncated = true;
            file.write_all(truncation_line().as_bytes())
                .await
                .map_err(|e| format!("writing {}: {e}", path.display()))?;
        }
        // In the file (tokio's writes finish in the background until flushed), then said.
        file.flush()
            .await
            .map_err(|e| format!("writing {}: {e}", path.display()))?;
        bump(signal);
    }
    file.flush()
        .await
        .map_err(|e| format!("writing {}: {e}", path.display()))?;
    file.sync_all()
        .await
        .map_err(|e| format!("writing {}: {e}", path.display()))
}

/// The output in `path` from `offset` on, at most [`JOB_LOG_CHUNK_MAX`] bytes; `complete` when
/// `ended` (nothing more will be written) and the chunk reaches the end of the file. `None`
/// when there is nothing to say: no new bytes and not complete.
pub fn chunk(path: &Path, offset: u64, ended: bool) -> Option<LogChunk> {
    let mut data = Vec::new();
    let mut len = 0;
    if let Ok(mut file) = std::fs::File::open(path) {
        len = file.metadata().map(|m| m.len()).unwrap_or(0);
        if offset < len && file.seek(SeekFrom::Start(offset)).is_ok() {
            let _ = file.take(JOB_LOG_CHUNK_MAX as u64).read_to_end(&mut data);
        }
    }
    let complete = ended && offset + data.len() as u64 >= len;
    (complete || !data.is_empty()).then_some(LogChunk {
        offset,
        data,
        complete,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test]
    async fn output_past_the_cap_becomes_one_line() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("job.log");
        let mib = vec![b'x'; 1024 * 1024];
        let count = JOB_LOG_CAP / (1024 * 1024) + 3;
        let output = futures::stream::iter((0..count).map(move |_| Ok(mib.clone()))).boxed();
        let signal: OutputSignal = Arc::new(watch::channel(0).0);
        let seen = signal.subscribe();
        copy_capped(output, &path, &signal).await.unwrap();
        assert_eq!(
            *seen.borrow(),
            JOB_LOG_CAP / (1024 * 1024) + 1,
            "every piece written is signalled, up to the one that is cut"
        );
        let text = std::fs::read(&path).unwrap();
        let line = truncation_line();
        assert_eq!(text.len() as u64, JOB_LOG_CAP + line.len() as u64);
        assert!(text.ends_with(line.as_bytes()));
        assert!(text[..JOB_LOG_CAP as usize].iter().all(|b| *b == b'x'));
    }

    #[test]
    fn chunks_follow_the_offset_and_say_when_complete() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("job.log");
        assert_eq!(chunk(&path, 0, false), None, "no file, nothing to say");
        let big = vec![b'y'; JOB_LOG_CHUNK_MAX + 10];
        std::fs::write(&path, &big).unwrap();
        let first = chunk(&path, 0, true).unwrap();
        assert_eq!(
            (first.data.len(), first.complete),
            (JOB_LOG_CHUNK_MAX, false)
        );
        let rest = chunk(&path, JOB_LOG_CHUNK_MAX as u64, true).unwrap();
        assert_eq!((rest.data.len(), rest.complete), (10, true));
        let end = chunk(&path, big.len() as u64, true).unwrap();
        assert!(
            end.data.is_empty() && end.complete,
            "the end is said once all was sent"
        );
        assert_eq!(chunk(&path, big.len() as u64, false), None);
        let running = chunk(&path, 5, false).unwrap();
        assert!(!running.complete);
    }
}
