/* One build's gallery: every image its generate jobs made, newest first, with the device and
   workload each came from. Reads /v1/builds/{name} and /v1/builds/{name}/gallery. */
(function () {
  "use strict";
  const { api, el, fmt, pageId, imageSource } = window.farm;

  window.farm.start(async () => {
    const name = pageId();
    const path = `/v1/builds/${encodeURIComponent(name)}`;
    const [build, gallery] = await Promise.all([api(path), api(`${path}/gallery`)]);
    document.title = `${build.name} gallery · devicefarm`;
    const figures = [];
    for (const image of gallery.images) {
      const img = el("img", { class: "gallery-image", alt: `${image.device}: ${image.prompt}`,
        dataset: { imageId: image.id } });
      img.src = await imageSource(image);
      figures.push(el("figure", { dataset: { imageId: image.id, device: image.device } },
        img, el("figcaption", {}, `${image.device}, job ${image.job}: ${image.workload}, seed ${image.seed ?? "—"}`,
          el("br"), el("q", {}, image.prompt))));
    }
    document.getElementById("content").replaceChildren(
      el("h1", { id: "gallery-title" }, `Images of build ${build.name}`),
      el("p", { class: "muted" }, `Version ${build.version}, made ${fmt.when(build.created)}; ` +
        `${gallery.images.length} image${gallery.images.length === 1 ? "" : "s"} from its generate jobs, newest first.`),
      figures.length ? el("div", { class: "gallery", id: "gallery" }, figures)
        : el("p", { class: "muted", id: "gallery" }, "No generate job of this build has made an image."));
  });
})();
