//! A future that ends even when its caller stops waiting for it.
//!
//! `tokio::spawn(f).await` gives that, at the price of a hand-off each way through the
//! runtime's queues: at load the spawned task waits behind every task queued before it
//! before its first poll (a new chat's start waited up to 2.8 ms there at 1,000 streams).
//! [`outliving`] polls `f` in the caller's own task while the caller waits, and spawns what
//! is left of it only if the caller drops it first.

use std::future::Future;
use std::panic::AssertUnwindSafe;
use std::pin::Pin;
use std::task::{Context, Poll};

/// Polls `future` where it is awaited; dropped before it ends, what is left of it goes on in
/// a task of its own. A panic inside it ends it with [`Panicked`], as a spawned task's
/// would with a `JoinError`.
pub fn outliving<F>(future: F) -> Outliving<F::Output>
where
    F: Future + Send + 'static,
    F::Output: Send + 'static,
{
    Outliving { future: Some(Box::pin(future)) }
}

/// See [`outliving`].
pub struct Outliving<T: Send + 'static> {
    /// `None` once it ended.
    future: Option<Pin<Box<dyn Future<Output = T> + Send>>>,
}

/// The future panicked (a bug); the panic was reported by the panic hook.
#[derive(Debug)]
pub struct Panicked;

impl<T: Send + 'static> Future for Outliving<T> {
    type Output = Result<T, Panicked>;

    fn poll(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Self::Output> {
        let future = self.future.as_mut().expect("an ended future is not polled again");
        let polled = std::panic::catch_unwind(AssertUnwindSafe(|| future.as_mut().poll(cx)));
        let ended = match polled {
            Ok(Poll::Pending) => return Poll::Pending,
            Ok(Poll::Ready(output)) => Ok(output),
            Err(_) => Err(Panicked),
        };
        self.future = None;
        Poll::Ready(ended)
    }
}

impl<T: Send + 'static> Drop for Outliving<T> {
    fn drop(&mut self) {
        let Some(future) = self.future.take() else { return };
        // Outside a runtime (its shutdown) there is nowhere left to go on.
        if let Ok(runtime) = tokio::runtime::Handle::try_current() {
            runtime.spawn(async move {
                let _ = future.await;
            });
        }
    }
}

#[cfg(test)]
mod tests {
    use std::time::Duration;

    use futures_util::FutureExt;
    use tokio::sync::oneshot;

    use super::*;

    #[tokio::test]
    async fn gives_what_the_future_gives_in_the_callers_task() {
        let (caller, ran_in) = tokio::spawn(async {
            let ran_in = outliving(async { tokio::task::id() }).await.unwrap();
            (tokio::task::id(), ran_in)
        })
        .await
        .unwrap();
        assert_eq!(ran_in, caller);
    }

    #[tokio::test]
    async fn goes_on_in_a_task_of_its_own_when_its_caller_leaves() {
        let (go, wait) = oneshot::channel::<()>();
        let (done, finished) = oneshot::channel();
        let mut future = outliving(async move {
            wait.await.unwrap();
            done.send("finished").unwrap();
        });
        // Polled once (it waits), then dropped by its caller.
        assert!((&mut future).now_or_never().is_none());
        drop(future);
        go.send(()).unwrap();
        let got = tokio::time::timeout(Duration::from_secs(5), finished).await;
        assert_eq!(got.expect("it went on").unwrap(), "finished");
    }

    #[tokio::test]
    async fn goes_on_when_dropped_before_its_first_poll() {
        let (done, finished) = oneshot::channel();
        drop(outliving(async move { done.send(1).unwrap() }));
        assert_eq!(tokio::time::timeout(Duration::from_secs(5), finished).await.unwrap().unwrap(), 1);
    }

    #[tokio::test]
    async fn a_panic_inside_is_an_error_for_the_caller() {
        let ended = outliving(async {
            if std::hint::black_box(true) {
                panic!("a bug");
            }
        })
        .await;
        assert!(ended.is_err());
    }
}
