//! A read that many requests at once share: each caller needs a read that started after its
//! call (so its answer reflects every commit before it), and one such read serves every caller
//! that waited for it. Thirty-two session requests arriving together read the site's inventory
//! about twice, not thirty-two times.

use std::future::Future;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;

/// The last read and its number; reads run one at a time.
pub struct SharedRead<T> {
    last: tokio::sync::Mutex<Option<(u64, Arc<T>)>>,
    /// Reads started, counted under `last`'s lock.
    started: AtomicU64,
}

impl<T> Default for SharedRead<T> {
    fn default() -> Self {
        Self {
            last: tokio::sync::Mutex::new(None),
            started: AtomicU64::new(0),
        }
    }
}

impl<T> SharedRead<T> {
    /// The value of a read that started after this call: the one another caller started
    /// meanwhile, or `read` run here. A failed read is not kept; the caller gets its error.
    pub async fn get<E, F, Fut>(&self, read: F) -> Result<Arc<T>, E>
    where
        F: FnOnce() -> Fut,
        Fut: Future<Output = Result<T, E>>,
    {
        let needed = self.started.load(Ordering::SeqCst) + 1;
        let mut last = self.last.lock().await;
        if let Some((number, value)) = &*last {
            if *number >= needed {
                return Ok(value.clone());
            }
        }
        let number = self.started.fetch_add(1, Ordering::SeqCst) + 1;
        let value = Arc::new(read().await?);
        *last = Some((number, value.clone()));
        Ok(value)
    }
}

#[cfg(test)]
mod tests {
    use std::sync::atomic::AtomicUsize;
    use std::time::Duration;

    use super::*;

    /// Callers that wait while a read runs share the next one; a caller after a read never
    /// gets that read's value.
    #[tokio::test]
    async fn callers_waiting_together_share_one_read_started_after_their_calls() {
        let shared = Arc::new(SharedRead::<usize>::default());
        let reads = Arc::new(AtomicUsize::new(0));
        let read = |reads: Arc<AtomicUsize>| async move {
            tokio::time::sleep(Duration::from_millis(50)).await;
            Ok::<_, ()>(reads.fetch_add(1, Ordering::SeqCst) + 1)
        };
        // One read under way...
        let first = {
            let (shared, reads) = (shared.clone(), reads.clone());
            tokio::spawn(async move { *shared.get(|| read(reads)).await.unwrap() })
        };
        tokio::time::sleep(Duration::from_millis(10)).await;
        // ...and ten callers arriving while it runs.
        let waiting: Vec<_> = (0..10)
            .map(|_| {
                let (shared, reads) = (shared.clone(), reads.clone());
                tokio::spawn(async move { *shared.get(|| read(reads)).await.unwrap() })
            })
            .collect();
        assert_eq!(first.await.unwrap(), 1);
        for caller in waiting {
            // Not the read that was under way when they called: the one after it.
            assert_eq!(caller.await.unwrap(), 2);
        }
        assert_eq!(reads.load(Ordering::SeqCst), 2);
        // A caller after both reads runs its own.
        assert_eq!(*shared.get(|| read(reads.clone())).await.unwrap(), 3);
    }

    #[tokio::test]
    async fn a_failed_read_is_not_kept() {
        let shared = SharedRead::<u32>::default();
        assert_eq!(
            shared.get(|| async { Err::<u32, _>("down") }).await.err(),
            Some("down")
        );
        assert_eq!(*shared.get(|| async { Ok::<_, ()>(7) }).await.unwrap(), 7);
    }
}
